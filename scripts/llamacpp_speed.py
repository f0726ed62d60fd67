"""llama.cpp's own speed on a GGUF (llama-cpp-python, 2 threads): one 512-token prefill (best of
three) and batch-1 greedy decode after a 32-token prompt (64 steps, three rounds). One JSON line.

    python scripts/llamacpp_speed.py MODEL.gguf [threads]
"""

import json
import statistics
import sys
import time

import llama_cpp
import numpy as np

threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=2048, n_threads=threads, n_batch=512,
                      verbose=False)
toks = [(t * 37) % 1000 + 10 for t in range(512)]
pp = 0.0
for _ in range(3):
    llm.reset()
    t = time.time()
    llm.eval(toks)
    pp = max(pp, 512 / (time.time() - t))
rounds = []
for _ in range(3):
    llm.reset()
    llm.eval(toks[:32])
    t = time.time()
    for _ in range(64):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    rounds.append(64 / (time.time() - t))
print(json.dumps({"impl": "llama.cpp", "version": llama_cpp.__version__, "threads": threads,
                  "prefill512_tok_s": pp, "batch1_tok_s": statistics.median(rounds),
                  "rounds": rounds}))
