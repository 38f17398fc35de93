"""Median ms of one 1-token and one 5-token decode of the Qwen2.5-Coder-1.5B Q4_K_M target after a
64-token context (run by contention.sh under different OpenMP settings)."""
import os
import statistics
import sys
import time

import torch

from specdec.models.base import Attention
from specdec.models.loading import load

t = load("/work/models/gguf/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
c = t.new_cache(); t.extend(torch.arange(1000, 1064), c)
out = {}
for k in (1, 5):
    ts = []
    for _ in range(5):
        s = time.perf_counter()
        t.forward(torch.arange(2000, 2000 + k), torch.arange(64, 64 + k), c, Attention.chain(k))
        ts.append(time.perf_counter() - s)
        c.crop(0)
    out[k] = round(statistics.median(ts) * 1000, 1)
print(os.environ.get("OMP_WAIT_POLICY", "default"), sys.argv[1:], out)
