"""Two base models behind one endpoint through the official `openai` package, against a graph
like graphs/models.yaml (SmolLM2 and the tiny model).

Usage: models.py BASE_URL. Prints, one JSON line each: the models the client lists; for each
model, a greedy completion (the model the answer names and its prompt's token count) and a
streamed chat answer (its model, whether it has text); and the error the client raises for a
model that is not served.
"""
import json
import sys

from openai import OpenAI

from served import not_served, streamed_chat

client = OpenAI(base_url=sys.argv[1], api_key="unused")
print(json.dumps([m.id for m in client.models.list().data]))
for model in ("smollm2", "tiny"):
    r = client.completions.create(
        model=model, prompt="The quick brown fox", max_tokens=4, temperature=0
    )
    print(json.dumps({"model": r.model, "prompt_tokens": r.usage.prompt_tokens}))
    streamed_chat(client, model, "Hi!", 4)
not_served(client, "other")
