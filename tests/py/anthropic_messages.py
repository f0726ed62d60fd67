"""Anthropic's Messages API on a running dyn graph serving SmolLM2, with the official
`anthropic` package: unary and streamed (the SDK's accumulating stream), a tool forced and a
tool-result turn, stop sequences, count_tokens, and errors in Anthropic's shape.

Usage: anthropic_messages.py BASE_URL MODEL. Prints one JSON line per check and exits non-zero
at the first failure, for the Rust test to report.
"""
import json
import sys

import anthropic
import httpx
import jsonschema
from served import WEATHER

BASE = sys.argv[1]
MODEL = sys.argv[2]
client = anthropic.Anthropic(base_url=BASE, api_key="unused")


def report(name, **seen):
    print(json.dumps({"check": name, **seen}), flush=True)


ASK = [{"role": "user", "content": "What is the capital of France?"}]

# Unary: a text block, a stop reason, usage.
m = client.messages.create(model=MODEL, max_tokens=24, temperature=0, system="Answer in one sentence.", messages=ASK)
assert m.type == "message" and m.role == "assistant", m
assert m.content[0].type == "text" and m.content[0].text.strip(), m.content
assert m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason
assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 24, m.usage
first = m
report("unary", text=m.content[0].text, stop_reason=m.stop_reason)

# Streamed through the SDK's helper: the text deltas add up to the unary answer (greedy), and
# the accumulated message has the same stop reason and usage.
with client.messages.stream(model=MODEL, max_tokens=24, temperature=0, system="Answer in one sentence.", messages=ASK) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
assert text == final.content[0].text == first.content[0].text, (text, final.content, first.content)
assert final.stop_reason == first.stop_reason, final
assert final.usage.output_tokens == first.usage.output_tokens, final.usage
assert final.usage.input_tokens == first.usage.input_tokens, final.usage
report("streamed", text=text)

# The raw events, in Anthropic's order.
kinds = [e.type for e in client.messages.create(
    model=MODEL, max_tokens=8, temperature=0, messages=ASK, stream=True)]
assert kinds[0] == "message_start", kinds
assert kinds[-2:] == ["message_delta", "message_stop"], kinds
assert "content_block_start" in kinds and "content_block_delta" in kinds and "content_block_stop" in kinds, kinds
report("events", kinds=kinds[:4] + ["..."] + kinds[-3:])

# A stop sequence from the unary answer's own words: the answer stops before it, and says so.
words = first.content[0].text.split()
stop = words[len(words) // 2] if len(words) > 2 else words[-1]
m = client.messages.create(model=MODEL, max_tokens=24, temperature=0, system="Answer in one sentence.",
                           messages=ASK, stop_sequences=[stop])
assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, (m.stop_reason, m.stop_sequence, stop)
assert stop not in m.content[0].text and first.content[0].text.startswith(m.content[0].text), (m.content, stop)
report("stop_sequence", stop=stop, text=m.content[0].text)

# A tool, forced: a tool_use block whose input is valid for its schema.
TOOLS = [{"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
m = client.messages.create(model=MODEL, max_tokens=100, messages=WEATHER_ASK, tools=TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
uses = [b for b in m.content if b.type == "tool_use"]
assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", m
jsonschema.validate(uses[0].input, WEATHER)
report("tool_use", input=uses[0].input)

# Streamed, the same call arrives as input_json_delta and accumulates into the same input.
with client.messages.stream(model=MODEL, max_tokens=100, messages=WEATHER_ASK, tools=TOOLS,
                            tool_choice={"type": "any"}) as s:
    final = s.get_final_message()
uses_streamed = [b for b in final.content if b.type == "tool_use"]
# `any` allows parallel calls: the model may make more than one, each valid.
assert final.stop_reason == "tool_use" and len(uses_streamed) >= 1, final
for u in uses_streamed:
    jsonschema.validate(u.input, WEATHER)
report("tool_use_streamed", input=uses_streamed[0].input)

# The tool's result in the next turn: text back.
m = client.messages.create(model=MODEL, max_tokens=32, temperature=0, tools=TOOLS, messages=WEATHER_ASK + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 degrees and sunny"}]},
])
assert m.content[0].type == "text" and m.content[0].text.strip() and m.stop_reason != "tool_use", m
report("tool_result_turn", text=m.content[0].text)

# count_tokens: the prompt's tokens as the answer's usage counts them.
n = client.messages.count_tokens(model=MODEL, system="Answer in one sentence.", messages=ASK)
assert n.input_tokens == first.usage.input_tokens, (n, first.usage)
report("count_tokens", input_tokens=n.input_tokens)

# Errors in Anthropic's shape: an unknown model, a missing max_tokens.
try:
    client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    raise AssertionError("an unknown model was served")
except anthropic.NotFoundError as e:
    assert e.body["type"] == "error" and e.body["error"]["type"] == "not_found_error", e.body
r = httpx.post(f"{BASE}/v1/messages", json={"model": MODEL, "messages": ASK}, headers={"x-api-key": "unused"})
assert r.status_code == 400, r.status_code
body = r.json()
assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
assert "max_tokens" in body["error"]["message"], body
report("errors", missing_max_tokens=body["error"]["message"])
report("done", ok=True)
