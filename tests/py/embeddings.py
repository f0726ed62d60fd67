"""`embeddings.create` with the official `openai` package against a running dyn graph: its
default (base64, decoded by the client), floats, token-id inputs, and a refused `dimensions`.

Usage: embeddings.py BASE_URL MODEL JSON_LIST_OF_TEXTS. Prints one JSON line per check (the
last with the vectors), and exits non-zero at the first failure.
"""
import json
import sys

from openai import BadRequestError, OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused")
MODEL = sys.argv[2]
texts = json.loads(sys.argv[3])


def report(name, **seen):
    print(json.dumps({"check": name, **seen}), flush=True)


# The client's default: it asks for base64 and decodes the floats itself.
r = client.embeddings.create(model=MODEL, input=texts)
assert r.object == "list" and len(r.data) == len(texts), r
assert [d.index for d in r.data] == list(range(len(texts))), r.data
assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens, r.usage
b64 = [d.embedding for d in r.data]
report("base64", n=len(b64), width=len(b64[0]), usage=r.usage.model_dump())

f = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
floats = [d.embedding for d in f.data]
assert all(abs(x - y) < 1e-7 for a, b in zip(floats, b64) for x, y in zip(a, b)), "base64 != float"
report("float", same_as_base64=True)

# One string alone is the same as in a list.
one = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float").data[0].embedding
assert max(abs(x - y) for x, y in zip(one, floats[0])) < 1e-5
report("single", ok=True)

try:
    client.embeddings.create(model=MODEL, input=texts[0], dimensions=7)
    raise AssertionError("dimensions=7 was accepted")
except BadRequestError as e:
    assert e.body["param"] == "dimensions", e.body
report("dimensions_refused", ok=True)
report("vectors", vectors=floats)
