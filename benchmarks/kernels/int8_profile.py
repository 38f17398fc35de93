"""Torch profiler over five one-token forwards of a real int8 target (usage: python int8_profile.py MODEL_DIR):
which ops take the time (the oneDNN matmul was 82% on the 1.5B here)."""
import sys

from torch.profiler import ProfilerActivity, profile

from specdec.bench.forward import prefilled_cache, time_block
from specdec.models.loading import load

m = load(sys.argv[1], quantize="int8")
cache = prefilled_cache(m, 1, 64)
print("T(1) ms", time_block(m, cache, 1, 10) * 1e3)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    time_block(m, cache, 1, 5)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
