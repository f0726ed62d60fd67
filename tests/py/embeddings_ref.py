"""Reference embeddings from transformers: a model's final hidden states (after its last
norm), pooled (the last token's, or the mean of all) and normalised, in float32.

Usage: embeddings_ref.py HF_DIR last|mean JSON_LIST_OF_TOKEN_ID_LISTS. Prints one JSON line:
the list of vectors.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
model.eval()
pooling = sys.argv[2]
out = []
with torch.no_grad():
    for ids in json.loads(sys.argv[3]):
        h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        v = h[-1] if pooling == "last" else h.mean(0)
        out.append(torch.nn.functional.normalize(v, dim=0).tolist())
print(json.dumps(out))
