"""One row of scripts/embed-bench: embeddings per second at batch 32, from a server's
`/v1/embeddings` (--url NAME=URL) or from transformers in this process (--transformers DIR,
f32, a right-padded batch, the last real token's final hidden state, normalised). Prints one JSON
line: name, inputs per second, mean milliseconds per batch.
"""
import argparse
import json
import random
import time

ap = argparse.ArgumentParser()
ap.add_argument("--batches", type=int, default=8)
ap.add_argument("--words", type=int, default=48)
ap.add_argument("--url")
ap.add_argument("--transformers")
a = ap.parse_args()

WORDS = ("model serving graph token cache router engine batch prompt vector embed layer "
         "attention weight decode prefill stream worker request answer").split()


def batch(seed):
    r = random.Random(seed)
    return [f"{seed} {i} " + " ".join(r.choice(WORDS) for _ in range(a.words)) for i in range(32)]


if a.url:
    import httpx
    name, url = a.url.split("=", 1)
    client = httpx.Client(timeout=600)

    def run(texts):
        r = client.post(f"{url}/v1/embeddings", json={"model": "smollm2", "input": texts, "encoding_format": "float"})
        r.raise_for_status()
        assert len(r.json()["data"]) == len(texts)
else:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    name = "transformers"
    tok = AutoTokenizer.from_pretrained(a.transformers)
    tok.padding_side = "right"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.transformers, dtype=torch.float32).eval()

    def run(texts):
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            h = model(**enc, output_hidden_states=True).hidden_states[-1]
        last = enc["attention_mask"].sum(1) - 1
        v = h[torch.arange(h.shape[0]), last]
        torch.nn.functional.normalize(v, dim=1)

run(batch(-1))
started = time.perf_counter()
for b in range(a.batches):
    run(batch(b))
took = time.perf_counter() - started
print(json.dumps({"name": name, "per_s": 32 * a.batches / took, "batch_ms": took * 1e3 / a.batches}))
