"""A GGUF file as a Hugging Face directory (f32 safetensors, tokenizer files), through
transformers' own GGUF reading, for engines that load directories (vLLM) and for exact prompt
lengths in `dyn bench --tokenizer`. The `quantization_config` transformers writes is dropped.

    python scripts/gguf_to_hf.py MODEL.gguf OUT_DIR
"""

import json
import os
import sys

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
os.makedirs(out, exist_ok=True)
# transformers refuses save_pretrained on a model it read from GGUF: write the weights and the
# config ourselves. With tied embeddings keep `model.embed_tokens.weight` and leave out
# `lm_head.weight`, as HF checkpoints do (safetensors' save_model may keep the other copy of a
# shared tensor, and loaders such as vLLM then find no embeddings).
sd = model.state_dict()
if model.config.tie_word_embeddings:
    sd.pop("lm_head.weight", None)
sd = {k: v.contiguous().clone() for k, v in sd.items()}
safetensors.torch.save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
cfg = model.config.to_dict()
cfg.pop("quantization_config", None)
cfg["torch_dtype"] = "float32"
cfg["architectures"] = [type(model).__name__]
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
model.generation_config.save_pretrained(out)
tok.save_pretrained(out)
print(out)
