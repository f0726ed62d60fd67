"""LoRA adapters through the official `openai` package, against `dyn graph up graphs/lora.yaml`.

Usage: lora.py BASE_URL PROMPT_IDS_JSON. Prints, one JSON line each: the models the client
lists (id, parent); the greedy token ids of each of `tiny`, `qv` and `all` for the prompt
(completions with token ids, extra_body return_token_ids) with the model the answer names;
a streamed chat answer from `qv` (its model and whether it has text); and the error the
client raises for an adapter that is not served.
"""
import json
import sys

import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused")
prompt = json.loads(sys.argv[2])
print(json.dumps([[m.id, getattr(m, "parent", None)] for m in client.models.list().data]))
for model in ("tiny", "qv", "all"):
    r = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    print(json.dumps({"model": r.model, "ids": r.choices[0].model_extra["token_ids"]}))
stream = client.chat.completions.create(
    model="qv",
    messages=[{"role": "user", "content": "Tell me a short story."}],
    max_tokens=8,
    stream=True,
)
models, text = set(), []
for chunk in stream:
    models.add(chunk.model)
    if chunk.choices and chunk.choices[0].delta.content:
        text.append(chunk.choices[0].delta.content)
print(json.dumps({"models": sorted(models), "text": bool("".join(text))}))
try:
    client.completions.create(model="mlp", prompt="hi", max_tokens=1)
    print(json.dumps({"error": None}))
except openai.NotFoundError as e:
    print(json.dumps({"error": "NotFoundError", "status": e.status_code}))
