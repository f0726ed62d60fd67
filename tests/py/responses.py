"""OpenAI's Responses API on a running dyn graph serving SmolLM2, with the official `openai`
package: unary and streamed (raw events and the SDK's own accumulating stream), a function
tool and a tool-output turn, structured output (`text.format` and the SDK's pydantic `parse`),
and stored responses (`previous_response_id`, retrieve, delete).

Usage: responses.py BASE_URL MODEL. Prints one JSON line per check and exits non-zero at the
first failure, for the Rust test to report.
"""
import json
import sys

import jsonschema
from openai import NotFoundError, BadRequestError, OpenAI
from pydantic import BaseModel
from served import WEATHER

client = OpenAI(base_url=sys.argv[1], api_key="unused")
MODEL = sys.argv[2]


def report(name, **seen):
    print(json.dumps({"check": name, **seen}), flush=True)


# Unary: text back, as a completed response with its usage.
r = client.responses.create(
    model=MODEL, input="What is the capital of France?", instructions="Answer in one sentence.",
    max_output_tokens=24, temperature=0,
)
assert r.object == "response" and r.status in ("completed", "incomplete"), r
assert r.id.startswith("resp_"), r.id
assert r.output_text.strip(), r
assert r.output[-1].type == "message" and r.output[-1].content[0].type == "output_text", r.output
assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24, r.usage
assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage
assert r.instructions == "Answer in one sentence.", r.instructions
first = r
report("unary", text=r.output_text, usage=r.usage.model_dump())

# The same request streamed: the Responses events in order, the deltas adding up to the answer,
# which is the unary one (greedy).
events = list(client.responses.create(
    model=MODEL, input="What is the capital of France?", instructions="Answer in one sentence.",
    max_output_tokens=24, temperature=0, stream=True,
))
kinds = [e.type for e in events]
assert kinds[:2] == ["response.created", "response.in_progress"], kinds
assert kinds[-1] == "response.completed" or kinds[-1] == "response.incomplete", kinds
assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds, kinds
assert [e.sequence_number for e in events] == list(range(len(events))), kinds
text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
final = events[-1].response
assert text == final.output_text == first.output_text, (text, final.output_text, first.output_text)
report("streamed", events=len(events), kinds=sorted(set(kinds)))

# The SDK's own stream helper accumulates the events into the same response.
with client.responses.stream(
    model=MODEL, input="What is the capital of France?", instructions="Answer in one sentence.",
    max_output_tokens=24, temperature=0,
) as stream:
    deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    done = stream.get_final_response()
assert deltas == done.output_text == first.output_text, (deltas, done.output_text)
report("stream_helper", text=done.output_text)

# A function tool, its call forced: a function_call item with arguments valid for its schema.
TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
          "parameters": WEATHER, "strict": True}]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
r = client.responses.create(
    model=MODEL, input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
    parallel_tool_calls=False, max_output_tokens=100,
)
calls = [o for o in r.output if o.type == "function_call"]
assert len(calls) == 1 and calls[0].name == "get_weather", r.output
jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
assert calls[0].call_id and calls[0].id, calls[0]
report("function_call", arguments=calls[0].arguments)

# The tool's output in the next turn, the conversation continued from the stored response: the
# model answers in text.
r2 = client.responses.create(
    model=MODEL, previous_response_id=r.id, tools=TOOLS, max_output_tokens=32, temperature=0,
    input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}],
)
assert r2.previous_response_id == r.id, r2
assert r2.output_text.strip(), r2.output
assert not [o for o in r2.output if o.type == "function_call"], r2.output
# The earlier turns were in the prompt (the stateless turn below gets the same answer from them).
assert r2.usage.input_tokens > r.usage.input_tokens, (r.usage, r2.usage)
report("tool_output_turn", text=r2.output_text, input_tokens=r2.usage.input_tokens)

# The same turn without the store: the call and its output as input items (stateless).
r3 = client.responses.create(
    model=MODEL, tools=TOOLS, max_output_tokens=32, temperature=0, store=False,
    input=ASK + [c.model_dump(exclude_none=True) for c in calls]
    + [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}],
)
assert r3.output_text == r2.output_text, (r3.output_text, r2.output_text)
report("stateless_tool_turn", same=True)

# A streamed call: its arguments as function_call_arguments events. Greedy, so the answer is
# the same on every run; "required" still lets the model make more than one call, so the
# deltas are joined per output item, and each call's must be its done event's arguments and
# valid for the schema.
events = list(client.responses.create(
    model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=100,
    temperature=0, stream=True,
))
streamed, finished = {}, {}
for e in events:
    if e.type == "response.function_call_arguments.delta":
        streamed[(e.output_index, e.item_id)] = streamed.get((e.output_index, e.item_id), "") + e.delta
    elif e.type == "response.function_call_arguments.done":
        finished[(e.output_index, e.item_id)] = e.arguments
assert streamed and streamed.keys() == finished.keys(), (streamed, finished)
for item, args in sorted(streamed.items()):
    assert args == finished[item], (item, args, finished[item])
    jsonschema.validate(json.loads(args), WEATHER)
report("function_call_streamed", calls=len(streamed), arguments=[a for _, a in sorted(streamed.items())])

# Structured output: text.format json_schema, and the SDK's pydantic parse.
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40}},
    "required": ["name", "country"],
    "additionalProperties": False,
}
r = client.responses.create(
    model=MODEL, input="Describe Paris as JSON.", max_output_tokens=60,
    text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
)
jsonschema.validate(json.loads(r.output_text), CITY)
report("json_schema", text=r.output_text)


class City(BaseModel):
    name: str
    country: str


r = client.responses.parse(model=MODEL, input="Describe Paris as JSON.", max_output_tokens=60, text_format=City)
assert isinstance(r.output_parsed, City), r
report("parse", parsed=r.output_parsed.model_dump())

# Stored responses: retrieved as created, deleted, then gone (and a conversation cannot go on
# from them).
got = client.responses.retrieve(first.id)
assert got.id == first.id and got.output_text == first.output_text, got
deleted = client.responses.delete(first.id)
try:
    client.responses.retrieve(first.id)
    raise AssertionError("a deleted response was retrieved")
except NotFoundError:
    pass
try:
    client.responses.create(model=MODEL, input="Go on.", previous_response_id=first.id, max_output_tokens=4)
    raise AssertionError("a deleted response was continued")
except NotFoundError as e:
    assert e.body["param"] == "previous_response_id", e.body
report("store", retrieved=got.id)

# Not stored when asked not to be.
r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
try:
    client.responses.retrieve(r.id)
    raise AssertionError("a response made with store=false was stored")
except NotFoundError:
    pass
report("store_false", id=r.id)

# What it cannot serve is refused by name.
try:
    client.responses.create(model=MODEL, input="Hi", tools=[{"type": "web_search"}], max_output_tokens=4)
    raise AssertionError("a web_search tool was accepted")
except BadRequestError as e:
    assert e.body["param"] == "tools[0].type", e.body
report("refused", param="tools[0].type")
report("done", ok=True)
