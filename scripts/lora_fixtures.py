"""PEFT LoRA adapters for models/tiny and reference outputs from transformers + peft.

Writes models/tiny-lora/{qv,all,mlp}/ (adapter_config.json + adapter_model.safetensors, as
peft's save_pretrained writes them) and models/tiny-lora/reference.json: for a few prompts,
the greedy continuation and the prefill logits of the base model and of each adapter, in
float32 with eager attention.

- qv: r=8, alpha=16 on q_proj and v_proj (peft's default targets for Llama);
- all: r=4, alpha=8 on all seven projections, rslora (alpha / sqrt(r));
- mlp: r=2, alpha=4 on gate/up/down, with an alpha_pattern for down_proj.

peft initialises B to zero (an adapter that changes nothing); here A and B are random, so each
adapter changes the greedy tokens. Deterministic for a given torch version: run by
scripts/make-lora-fixtures.
"""

import json
import os
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
BASE = os.path.join(ROOT, "models/tiny")
OUT = os.path.join(ROOT, "models/tiny-lora")
STEPS = 12

ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all": dict(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp": dict(
        r=2,
        lora_alpha=4,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        alpha_pattern={"down_proj": 1},
    ),
}


def base_model():
    config = AutoConfig.from_pretrained(BASE)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_pretrained(BASE, config=config, dtype=torch.float32)
    model.eval()
    return model


def greedy(model, prompt):
    tokens = []
    with torch.no_grad():
        first = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        ids = list(prompt)
        for _ in range(STEPS):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            t = int(torch.argmax(logits))
            tokens.append(t)
            ids.append(t)
    return tokens, [float(f"{v:.7g}") for v in first.tolist()]


def main():
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    vocab = json.load(open(os.path.join(BASE, "config.json")))["vocab_size"]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 13, 21)]
    ref = {
        "transformers": __import__("transformers").__version__,
        "peft": __import__("peft").__version__,
        "torch": torch.__version__,
        "prompts": prompts,
        "outputs": {},
    }
    base = base_model()
    ref["outputs"]["base"] = [dict(zip(("greedy", "logits"), greedy(base, p))) for p in prompts]
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        model = get_peft_model(base_model(), LoraConfig(task_type="CAUSAL_LM", **kw))
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_A" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
                elif "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
        d = os.path.join(OUT, name)
        model.save_pretrained(d)
        os.remove(os.path.join(d, "README.md"))
        with open(os.path.join(d, "adapter_config.json")) as f:
            cfg = json.load(f)
        cfg["base_model_name_or_path"] = "models/tiny"  # not this machine's absolute path
        with open(os.path.join(d, "adapter_config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        # Reloaded as a user's adapter is: from the files.
        loaded = PeftModel.from_pretrained(base_model(), d)
        loaded.eval()
        ref["outputs"][name] = [dict(zip(("greedy", "logits"), greedy(loaded, p))) for p in prompts]
        changed = sum(a["greedy"] != b["greedy"] for a, b in zip(ref["outputs"][name], ref["outputs"]["base"]))
        print(f"{name}: changes {changed} of {len(prompts)} greedy continuations")
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")


SMOL_OUT = os.path.join(ROOT, "models/smollm2-lora")
SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
SMOL_STEPS = 16


def smollm2(hf):
    """A rank-2 adapter on q and v of SmolLM2-135M-Instruct (the HF directory scripts/test
    makes from the Q4_1 GGUF: its weights are the GGUF's, dequantized), stored in f16, and
    transformers + peft's greedy continuations with it in f32: models/smollm2-lora/."""
    from transformers import AutoTokenizer

    def load():
        config = AutoConfig.from_pretrained(hf)
        config._attn_implementation = "eager"
        m = AutoModelForCausalLM.from_pretrained(hf, config=config, dtype=torch.float32)
        m.eval()
        return m

    tok = AutoTokenizer.from_pretrained(hf)
    prompts = [tok(p)["input_ids"] for p in SMOL_PROMPTS]
    model = get_peft_model(load(), LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    gen = torch.Generator().manual_seed(200)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_A" in pname or "lora_B" in pname:
                # f16 values, so the stored f16 file is exactly what the reference ran.
                p.copy_((torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5).half().float())
    d = os.path.join(SMOL_OUT, "qv")
    model.save_pretrained(d)
    os.remove(os.path.join(d, "README.md"))
    import safetensors.torch

    f = os.path.join(d, "adapter_model.safetensors")
    tensors = {k: v.half() for k, v in safetensors.torch.load_file(f).items()}
    safetensors.torch.save_file(tensors, f, metadata={"format": "pt"})
    with open(os.path.join(d, "adapter_config.json")) as fh:
        cfg = json.load(fh)
    cfg["base_model_name_or_path"] = "SmolLM2-135M-Instruct"
    with open(os.path.join(d, "adapter_config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2, sort_keys=True)
        fh.write("\n")
    loaded = PeftModel.from_pretrained(load(), d)
    loaded.eval()
    base = load()
    global STEPS
    STEPS = SMOL_STEPS
    cases = []
    for p in prompts:
        with_adapter, _ = greedy(loaded, p)
        without, _ = greedy(base, p)
        cases.append({"prompt": p, "greedy": with_adapter, "base": without})
        print(f"smollm2 qv: {'changes' if with_adapter != without else 'keeps'} the continuation of {len(p)} tokens")
    ref = {
        "transformers": __import__("transformers").__version__,
        "peft": __import__("peft").__version__,
        "torch": torch.__version__,
        "cases": cases,
    }
    with open(os.path.join(SMOL_OUT, "reference.json"), "w") as fh:
        json.dump(ref, fh, separators=(",", ":"))
        fh.write("\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "smollm2":
        sys.exit(smollm2(sys.argv[2]))
    sys.exit(main())
