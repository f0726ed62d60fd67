"""Random-weight tiny checkpoints and reference outputs from Hugging Face transformers.

Writes, for each of llama (models/tiny, beside its tokenizer), qwen2 (models/tiny-qwen2:
q/k/v bias, tied embeddings, two shards) and mistral (models/tiny-mistral: sliding window 8,
bf16 weights):

- model.safetensors (or shards and model.safetensors.index.json),
- reference.json: for a few prompts, the greedy continuation and the full logits at the
  prefill and at each of the first decode steps, computed in float32 by transformers' eager
  attention.

Deterministic for a given torch version: run by scripts/make-native-fixtures.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
STEPS = 12  # greedy tokens per prompt
LOGIT_STEPS = 4  # logits rows kept: the prefill and 3 decode steps


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # matrices: unit-variance outputs
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def reference(model, prompts):
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        tokens, logits = [], []
        with torch.no_grad():
            past = None
            x = ids
            for step in range(STEPS):
                r = model(input_ids=x, past_key_values=past, use_cache=True)
                past = r.past_key_values
                last = r.logits[0, -1].float()
                if step < LOGIT_STEPS:
                    logits.append([float(f"{v:.7g}") for v in last.tolist()])
                t = int(torch.argmax(last))
                tokens.append(t)
                x = torch.tensor([[t]])
            # The cache path must agree with a plain full-sequence forward.
            full = model(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, -1]
            assert int(torch.argmax(full)) == tokens[-1]
        out.append({"prompt": prompt, "greedy": tokens, "logits": logits})
    return out


def build(kind, directory, overrides, seed, dtype, shards, tie):
    cfg_path = os.path.join(ROOT, directory, "config.json")
    if kind == "llama":
        with open(cfg_path) as f:
            base = json.load(f)
    else:
        with open(os.path.join(ROOT, "models/tiny/config.json")) as f:
            base = json.load(f)
        base.update(overrides)
        base["model_type"] = kind
        base["architectures"] = [kind.capitalize() + "ForCausalLM"]
        base["tie_word_embeddings"] = tie
        base["torch_dtype"] = "bfloat16" if dtype == torch.bfloat16 else "float32"
        os.makedirs(os.path.join(ROOT, directory), exist_ok=True)
        with open(cfg_path, "w") as f:
            json.dump(base, f, indent=2, sort_keys=True)
            f.write("\n")
    config = AutoConfig.for_model(**base)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    randomize(model, seed)
    if dtype != torch.float32:
        # The checkpoint is stored rounded; the reference runs on the rounded weights in f32.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight", None)
    d = os.path.join(ROOT, directory)
    for old in os.listdir(d):
        if old.startswith("model") and "safetensors" in old:
            os.remove(os.path.join(d, old))
    if shards == 1:
        save_file(state, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(state)
        per = (len(names) + shards - 1) // shards
        weight_map = {}
        for i in range(shards):
            part = names[i * per:(i + 1) * per]
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: state[n] for n in part}, os.path.join(d, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
            f.write("\n")
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [
        torch.randint(0, base["vocab_size"], (n,), generator=g).tolist() for n in (5, 13, 21)
    ]
    ref = {
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "prompts": reference(model, prompts),
    }
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")
    print(f"{directory}: {kind}, {sum(p.numel() for p in model.parameters())} parameters")


def main():
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    build("llama", "models/tiny", {}, 1, torch.float32, 1, False)
    build("qwen2", "models/tiny-qwen2", {}, 2, torch.float32, 2, True)
    build("mistral", "models/tiny-mistral", {"sliding_window": 8}, 3, torch.bfloat16, 1, False)


if __name__ == "__main__":
    sys.exit(main())
