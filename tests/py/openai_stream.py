"""Streams a chat completion from a running dyn graph with the official `openai` package.

Usage: openai_stream.py BASE_URL. Prints the streamed text on the first line and the finish
reason and usage on the second, then the errors the client raised for an unknown model and
for a field this server does not honour yet, as JSON, for the Rust test to check.
"""
import json
import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused")
stream = client.chat.completions.create(
    model="tiny",
    messages=[{"role": "user", "content": "Tell me a short story."}],
    max_tokens=10,
    seed=11,
    stream=True,
    stream_options={"include_usage": True},
)
text, finish, usage = [], None, None
for chunk in stream:
    if chunk.choices:
        delta = chunk.choices[0].delta
        if delta.content:
            text.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    if chunk.usage:
        usage = chunk.usage.model_dump()
print(json.dumps("".join(text)))
print(json.dumps({"finish_reason": finish, "usage": usage}))

# Errors come back as the client's typed exceptions.
try:
    client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
except Exception as e:  # noqa: BLE001 - report whatever the client raised
    print(json.dumps({"error": type(e).__name__, "status": getattr(e, "status_code", None)}))

# A field the request cannot mean (a bias on a token the model does not have) is refused,
# naming the field.
try:
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        logit_bias={"1000000": -100},
    )
except Exception as e:  # noqa: BLE001 - report whatever the client raised
    print(json.dumps({"error": type(e).__name__, "status": getattr(e, "status_code", None), "param": getattr(e, "param", None)}))
