"""Decode tokens/s of Hugging Face transformers (eager attention, CPU torch) on a checkpoint
directory, at batch 1 and 16, the same way compute/examples/native_bench.rs measures this engine:
a 32-token prompt per sequence, then timed greedy decode steps with the KV cache. With `cuda` the
model runs on the GPU (scripts/gpu-check), and each timing waits for the device to finish.

    python scripts/transformers_decode_bench.py MODEL_DIR f32|bf16 STEPS [cpu|cuda]
"""

import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

PROMPT = 32


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def decode(model, batch, steps, device):
    ids = torch.tensor(
        [[(t * 31 + i * 7) % 1000 for t in range(PROMPT)] for i in range(batch)], device=device
    )
    with torch.inference_mode():
        r = model(input_ids=ids, use_cache=True)
        past = r.past_key_values
        nxt = r.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            r = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = r.past_key_values
            nxt = r.logits[:, -1].argmax(-1, keepdim=True)
        sync(device)
        return batch * steps / (time.perf_counter() - start)


def main():
    d, dtype, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
    torch.set_num_threads(os.cpu_count() or 1)
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(d, dtype=dt, attn_implementation="eager")
    model.to(device).eval()
    decode(model, 1, 4, device)  # warm-up
    b1 = decode(model, 1, steps, device)
    b16 = decode(model, 16, steps, device)
    where = torch.cuda.get_device_name() if device == "cuda" else f"{torch.get_num_threads()} threads"
    print(json.dumps({"impl": f"transformers {__import__('transformers').__version__} eager, torch {torch.__version__}, {where}",
                      "dtype": dtype, "batch1_tok_s": b1, "batch16_tok_s": b16, "steps": steps}))


if __name__ == "__main__":
    main()
