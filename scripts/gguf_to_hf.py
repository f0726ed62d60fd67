"""A GGUF file as a Hugging Face directory (f32 safetensors, tokenizer files), through
transformers' own GGUF reading, for engines that load directories (vLLM) and for exact prompt
lengths in `dyn bench --tokenizer`. The `quantization_config` transformers writes is dropped.

    python scripts/gguf_to_hf.py MODEL.gguf OUT_DIR
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
model.save_pretrained(out)
tok.save_pretrained(out)
cfg_path = os.path.join(out, "config.json")
cfg = json.load(open(cfg_path))
cfg.pop("quantization_config", None)
json.dump(cfg, open(cfg_path, "w"), indent=2)
print(out)
