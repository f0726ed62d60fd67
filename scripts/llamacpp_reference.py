"""What llama.cpp (llama-cpp-python) makes of a GGUF, for dyn's quantized path to compare with:
greedy continuations of the prompts in the transformers fixture, and the perplexity of a fixed
text (models/tiny/corpus.txt, tokenized by transformers' reading of the same file).

    python scripts/llamacpp_reference.py MODEL.gguf models/smollm2-gguf-reference.json \
        > models/smollm2-llamacpp-reference.json
"""

import json
import math
import sys

import llama_cpp
import numpy as np

model, ref_path = sys.argv[1], sys.argv[2]
ref = json.load(open(ref_path))
llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_threads=2, n_batch=512, logits_all=True,
                      verbose=False)


def greedy(prompt, n):
    llm.reset()
    llm.eval(prompt)
    out = []
    for _ in range(n):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(t)
        llm.eval([t])
    return out


cases = []
for c in ref["cases"]:
    g = greedy(c["prompt"], len(c["greedy"]))
    cases.append({"prompt": c["prompt"], "greedy": g})
    print(c["kind"], llm.detokenize(g).decode(errors="replace")[:80].replace("\n", " "), file=sys.stderr)

tokens = ref["ppl_tokens"]
llm.reset()
llm.eval(tokens)
logits = np.asarray(llm.scores[: len(tokens)], dtype=np.float64)
nll = 0.0
for i in range(len(tokens) - 1):
    row = logits[i]
    m = row.max()
    lse = m + math.log(np.exp(row - m).sum())
    nll += lse - row[tokens[i + 1]]
ppl = math.exp(nll / (len(tokens) - 1))
print(f"perplexity {ppl:.4f} over {len(tokens) - 1} predictions", file=sys.stderr)
json.dump({"llama_cpp_python": llama_cpp.__version__, "cases": cases, "ppl": ppl,
           "ppl_predictions": len(tokens) - 1}, sys.stdout, indent=1)
