"""Every prompt form OpenAI documents for `/v1/completions`, sent by the official `openai`
package to a running dyn graph: a string, a list of strings, token ids, a list of token-id
lists, with `n` choices per prompt, streamed and not.

Usage: completions_prompts.py BASE_URL. Prints one JSON line per request: the choices' indexes
and texts (unary) or the indexes that streamed and finished (streamed), and the usage.
"""
import json
import sys

from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused")
for prompt, n in [
    ("Once upon a time", 1),
    (["Once upon a time", "The weather today"], 1),
    ([17, 42, 99, 5], 1),
    ([[17, 42, 99, 5], [8, 9, 10]], 2),
]:
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, n=n, seed=5)
    print(json.dumps({
        "indexes": [c.index for c in r.choices],
        "texts": [c.text for c in r.choices],
        "finish": [c.finish_reason for c in r.choices],
        "usage": r.usage.model_dump(include={"prompt_tokens", "completion_tokens"}),
    }))

# Streamed: every choice of every prompt streams under its own index and finishes.
stream = client.completions.create(
    model="tiny", prompt=["Once upon a time", "The weather today"], max_tokens=3, n=2,
    stream=True, seed=5,
)
texts, finished = {}, set()
for chunk in stream:
    for c in chunk.choices:
        texts[c.index] = texts.get(c.index, "") + (c.text or "")
        if c.finish_reason:
            finished.add(c.index)
print(json.dumps({"indexes": sorted(texts), "finished": sorted(finished)}))

# A prompt that is not one of those forms is the client's error, named.
try:
    client.completions.create(model="tiny", prompt=[[1, 2], "mixed"], max_tokens=3)
except Exception as e:  # noqa: BLE001 - report whatever the client raised
    print(json.dumps({"error": type(e).__name__, "status": getattr(e, "status_code", None)}))
