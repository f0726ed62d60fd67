"""PEFT LoRA adapters for a Hugging Face model directory, for benchmarks: N adapters of rank R
on all seven projections of every layer (q/k/v/o, gate/up/down), A and B random (B small, so
answers stay the model's kind of text), saved as save_pretrained does.

    python scripts/make_bench_loras.py MODEL_DIR OUT_DIR N [RANK]
"""

import os
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main():
    model_dir, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rank = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
                elif "lora_B" in name:
                    p.copy_(0.01 * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        d = os.path.join(out, f"a{i}")
        model.save_pretrained(d)
        print(d)


if __name__ == "__main__":
    sys.exit(main())
