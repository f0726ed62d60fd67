"""Two base models behind one endpoint through the official `openai` package, against a graph
like graphs/models.yaml (SmolLM2 and the tiny model).

Usage: models.py BASE_URL. Prints, one JSON line each: the models the client lists; for each
model, a greedy completion (the model the answer names and its prompt's token count) and a
streamed chat answer (its model, whether it has text); and the error the client raises for a
model that is not served.
"""
import json
import sys

import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="unused")
print(json.dumps([m.id for m in client.models.list().data]))
for model in ("smollm2", "tiny"):
    r = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=4, temperature=0
    )
    print(json.dumps({"model": r.model, "prompt_tokens": r.usage.prompt_tokens}))
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=4,
        stream=True,
    )
    models, text = set(), []
    for chunk in stream:
        models.add(chunk.model)
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    print(json.dumps({"models": sorted(models), "text": bool("".join(text))}))
try:
    client.completions.create(model="other", prompt="hi", max_tokens=1)
    print(json.dumps({"error": None}))
except openai.NotFoundError as e:
    print(json.dumps({"error": "NotFoundError", "status": e.status_code}))
