"""Test vectors for dyn's GGML block formats (compute/src/quant): random blocks of each type with
sane f16 scales, and their values as ggml's own Python package (`gguf`) dequantizes them.

    python scripts/make_quant_vectors.py > compute/tests/data/quant_vectors.json
"""

import json
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# (type, bytes per block, offsets of its f16 scale fields, blocks to make)
TYPES = [
    (T.Q4_0, 18, [0], 6),
    (T.Q4_1, 20, [0, 2], 6),
    (T.Q8_0, 34, [0], 6),
    (T.Q4_K, 144, [0, 2], 2),
    (T.Q5_K, 176, [0, 2], 2),
    (T.Q6_K, 210, [208], 2),
]

rng = np.random.default_rng(7)
out = {}
for ty, size, scales, n in TYPES:
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for off in scales:
        vals = (rng.uniform(0.002, 0.05, size=n) * rng.choice([-1, 1], size=n)).astype(np.float16)
        raw[:, off:off + 2] = vals.view(np.uint8).reshape(n, 2)
    values = dequantize(raw.reshape(-1), ty).reshape(-1)
    out[ty.name] = {"bytes": raw.reshape(-1).tobytes().hex(), "values": [float(v) for v in values]}
    print(f"{ty.name}: {n} blocks, {values.size} values", file=sys.stderr)
json.dump(out, sys.stdout)
