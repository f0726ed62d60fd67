"""LoRA adapters through the official `openai` package, against `dyn graph up graphs/lora.yaml`.

Usage: lora.py BASE_URL PROMPT_IDS_JSON. Prints, one JSON line each: the models the client
lists (id, parent); the greedy token ids of each of `tiny`, `qv` and `all` for the prompt
(completions with token ids, extra_body return_token_ids) with the model the answer names;
a streamed chat answer from `qv` (its model and whether it has text); and the error the
client raises for an adapter that is not served.
"""
import json
import sys

from openai import OpenAI

from served import not_served, streamed_chat

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
streamed_chat(client, "qv", "Tell me a short story.", 8)
not_served(client, "mlp")
