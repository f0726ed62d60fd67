"""Reference outputs of transformers on a GGUF file (dyn's GGUF tests compare with them):
token ids of a varied text set, chat-template renderings, and greedy continuations of chat
and plain prompts with the model dequantized to f32 (transformers' GGUF loading).

    python scripts/gguf_reference.py MODEL.gguf > models/smollm2-gguf-reference.json
"""

import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

path = sys.argv[1]
d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
model.eval()

TEXTS = [
    "Hello world!",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "naïve café, Ünïcödé, 日本語のテキスト, 한국어, emoji 🤖🎉 and ZWJ 👩‍💻",
    "def f(x):\n    return x ** 2  # square\n\n\tif x != 0:\n\t\tpass",
    "   leading spaces, trailing   \n\n\n  multiple\r\nnewlines \t tabs",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Special <|endoftext|> in the middle, and <|im_end|> too.",
    "URLs: https://example.com/a?b=c&d=e#f, emails: a.b@c.de",
    "",
    "      ",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What colour is the sky?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
]

PLAIN = ["The three primary colors are", "def fibonacci(n):", "Once upon a time"]

out = {
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "file": f,
    "tokenize": [{"text": t, "ids": tok(t, add_special_tokens=False)["input_ids"]} for t in TEXTS],
    "chat": [],
    "cases": [],
}
for messages in CHATS:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out["chat"].append({"messages": messages, "text": text, "ids": ids})
prompts = [("chat", c["messages"], c["ids"]) for c in out["chat"]] + [
    ("plain", p, tok(p)["input_ids"]) for p in PLAIN]
for kind, source, ids in prompts:
    with torch.no_grad():
        g = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    new = g[0, len(ids):].tolist()
    out["cases"].append({"kind": kind, "source": source, "prompt": ids, "greedy": new,
                         "text": tok.decode(new, skip_special_tokens=True)})
    print(kind, repr(tok.decode(new, skip_special_tokens=True)), file=sys.stderr)
# A fixed text for perplexity (dyn and llama.cpp both score it), and transformers' own.
corpus = open(os.path.join(os.path.dirname(__file__), "../models/tiny/corpus.txt")).read()
ppl_ids = tok(corpus)["input_ids"][:512]
with torch.no_grad():
    loss = model(torch.tensor([ppl_ids]), labels=torch.tensor([ppl_ids])).loss
out["ppl_tokens"] = ppl_ids
out["ppl_f32"] = float(torch.exp(loss))
print("perplexity (f32)", out["ppl_f32"], file=sys.stderr)
json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
