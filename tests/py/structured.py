"""Structured output, tool calls, the sampling knobs, log-probabilities and n choices from a
running dyn graph serving SmolLM2, with the official `openai` package; every JSON answer and
every call's arguments are checked against their schema with `jsonschema`.

Usage: structured.py BASE_URL MODEL. Prints one JSON line per check (name and what it saw) and
exits non-zero at the first failure, for the Rust test to report.
"""
import json
import sys

import jsonschema
from openai import BadRequestError, OpenAI
from pydantic import BaseModel
from served import WEATHER

client = OpenAI(base_url=sys.argv[1], api_key="unused")
MODEL = sys.argv[2]


def report(name, **seen):
    print(json.dumps({"check": name, **seen}), flush=True)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def check_call(call, schemas):
    assert call.type == "function", call
    assert call.id, call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schemas[call.function.name])
    return args


schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# A named function, unary: exactly that call, arguments valid.
r = client.chat.completions.create(
    model=MODEL, messages=ASK, tools=TOOLS, max_tokens=100, parallel_tool_calls=False,
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
)
c = r.choices[0]
assert c.finish_reason == "tool_calls", c
assert [t.function.name for t in c.message.tool_calls] == ["get_weather"], c
args = check_call(c.message.tool_calls[0], schemas)
report("named", args=args)

# `required`, streamed: the call arrives as tool_calls deltas, no markup as content.
stream = client.chat.completions.create(
    model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=100,
    parallel_tool_calls=False, stream=True,
)
calls, content, finish = {}, "", None
for chunk in stream:
    if not chunk.choices:
        continue
    d = chunk.choices[0].delta
    content += d.content or ""
    for t in d.tool_calls or []:
        slot = calls.setdefault(t.index, {"id": "", "name": "", "arguments": ""})
        slot["id"] += t.id or ""
        slot["name"] += (t.function.name or "") if t.function else ""
        slot["arguments"] += (t.function.arguments or "") if t.function else ""
    finish = chunk.choices[0].finish_reason or finish
assert finish == "tool_calls", finish
assert "<tool_call>" not in content, content
assert len(calls) == 1, calls
call = calls[0]
jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
report("required_streamed", call=call)

# A turn with the tool's result: the template renders the call and the result; text comes back.
turn = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
    }]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]
r = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=24, temperature=0)
assert r.choices[0].message.content, r
report("tool_result_turn", content=r.choices[0].message.content)

# A tool_choice naming no tool is refused, by name.
try:
    client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
        tool_choice={"type": "function", "function": {"name": "nope"}},
    )
    raise AssertionError("a tool_choice naming no tool was accepted")
except BadRequestError as e:
    assert e.body["param"] == "tool_choice", e.body
    report("unknown_tool_refused", status=e.status_code)

# json_schema (strict) and json_object.
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "country", "population", "landmarks"],
    "additionalProperties": False,
}
r = client.chat.completions.create(
    model=MODEL, max_tokens=120,
    messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}},
)
v = json.loads(r.choices[0].message.content)
jsonschema.validate(v, CITY)
report("json_schema", value=v)

r = client.chat.completions.create(
    model=MODEL, max_tokens=48, temperature=0,
    messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
    response_format={"type": "json_object"},
)
text = r.choices[0].message.content
if r.choices[0].finish_reason == "stop":
    assert isinstance(json.loads(text), dict), text
else:
    # Cut at max_tokens: still the start of an object.
    assert text.startswith("{"), text
report("json_object", text=text, finish=r.choices[0].finish_reason)


# The client's own structured-output helper: a pydantic model in, a parsed instance out.
class Answer(BaseModel):
    city: str
    is_capital: bool


r = client.chat.completions.parse(
    model=MODEL, max_tokens=48,
    messages=[{"role": "user", "content": "Is Paris the capital of France?"}],
    response_format=Answer,
)
parsed = r.choices[0].message.parsed
assert isinstance(parsed, Answer), r
report("parse_pydantic", parsed=parsed.model_dump())

# vLLM's extension: a choice and a regex.
r = client.chat.completions.create(
    model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Is the sky blue?"}],
    extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
)
assert r.choices[0].message.content in ("yes", "no"), r
r = client.chat.completions.create(
    model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "A date, please."}],
    extra_body={"structured_outputs": {"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
)
import re  # noqa: E402

assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].message.content), r
report("choice_and_regex", date=r.choices[0].message.content)

# The sampling knobs as the client sends them: OpenAI's penalties and logit bias, vLLM's
# repetition penalty, min_p and stop tokens (in extra_body); a +100 bias makes its token the
# whole answer.
SAY = [{"role": "user", "content": "Say hello."}]
r = client.chat.completions.create(
    model=MODEL, max_tokens=6, messages=SAY, temperature=0, logit_bias={"33": 100},
)
biased = r.choices[0].message.content
assert len(set(biased)) == 1, r
r = client.chat.completions.create(
    model=MODEL, max_tokens=12, messages=SAY, temperature=0.7, seed=1,
    frequency_penalty=1.0, presence_penalty=0.5,
    extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "stop_token_ids": [30]},
)
assert r.choices[0].finish_reason in ("stop", "length"), r
report("sampling_knobs", biased=biased, penalized=r.choices[0].message.content)

# Log-probabilities: chat's per-token list with alternatives, unary and streamed, and
# completions' echo with the prompt's log-probabilities (what lm-evaluation-harness sends for
# log-likelihoods), the first token without one.
r = client.chat.completions.create(
    model=MODEL, max_tokens=5, messages=SAY, temperature=0, logprobs=True, top_logprobs=3,
)
content = r.choices[0].logprobs.content
assert len(content) == r.usage.completion_tokens, r
assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content), content
# Greedy: each token is its position's most likely.
assert all(abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6 for t in content), content
streamed = []
for chunk in client.chat.completions.create(
    model=MODEL, max_tokens=5, messages=SAY, temperature=0, logprobs=True, stream=True,
):
    if chunk.choices and chunk.choices[0].logprobs:
        streamed.extend(chunk.choices[0].logprobs.content)
assert [t.token for t in streamed] == [t.token for t in content], (streamed, content)
PROMPT = "The capital of France is"
r = client.completions.create(
    model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1,
)
lp = r.choices[0].logprobs
assert r.choices[0].text.startswith(PROMPT), r
assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
assert all(x <= 0 for x in lp.token_logprobs[1:]), lp
assert len(lp.tokens) == r.usage.prompt_tokens + 1, lp
report("logprobs", chat=[t.token for t in content], echo_logprob=sum(lp.token_logprobs[1:-1]))

# n choices, seeded: three answers, indexed, the same again with the same seed.
ask3 = dict(model=MODEL, max_tokens=8, messages=SAY, temperature=1.0, seed=7, n=3)
r = client.chat.completions.create(**ask3)
assert [c.index for c in r.choices] == [0, 1, 2], r
again = client.chat.completions.create(**ask3)
assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
report("n", choices=[c.message.content for c in r.choices])

# A schema the grammar library rejects: 400 naming the problem.
try:
    client.chat.completions.create(
        model=MODEL, max_tokens=8, messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}},
    )
    raise AssertionError("an invalid schema was accepted")
except BadRequestError as e:
    assert "strnig" in e.body["message"], e.body
    report("bad_schema_refused", message=e.body["message"])
print(json.dumps({"ok": True}))
