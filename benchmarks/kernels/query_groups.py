"""T(k) of SmolLM2-135M-Instruct (int8 and exact bf16) for k-token blocks after 64 tokens.

Run once on each side of a change, alternating, on a quiet machine; the label is printed:
    PYTHONPATH=/path/to/old/checkout python benchmarks/kernels/query_groups.py before MODEL_DIR
    python benchmarks/kernels/query_groups.py after MODEL_DIR
MODEL_DIR: SmolLM2 as a transformers folder (the cache folder `specdec generate` converts it into,
~/.cache/specdec/smollm2-135m-instruct/target). Measured 2026-11-22, 2-core Xeon without AMX,
two alternations (ms, k = 1/2/3/5/8):
    before int8 19.1/25.4/28.0/33.4/45.0  bf16 exact 49.8/52.7/56.1/61.3/68.4
    after  int8 20.4/25.3/28.0/31.3/35.6  bf16 exact 50.3/50.5/52.1/52.9/55.4
    before int8 19.8/25.9/28.5/33.2/40.5  bf16 exact 51.0/53.7/56.7/60.6/68.8
    after  int8 19.9/25.2/27.2/30.5/35.2  bf16 exact 49.7/50.5/50.6/52.0/55.0
Then a chain's keys as a view of its row (QueryGroup.prefix_of_row) instead of a gathered copy,
alternated the same way (training paused), "gather" = the line above:
    gather      int8 21.6/26.2/27.5/31.3/36.0  bf16 exact 54.7/52.7/52.2/53.5/55.0
    prefix-view int8 19.1/23.2/24.7/27.5/30.6  bf16 exact 48.6/48.4/49.7/49.8/51.2
    gather      int8 20.7/25.7/27.7/31.3/35.7  bf16 exact 51.7/51.2/52.1/54.1/55.7
    prefix-view int8 19.3/23.8/25.3/27.5/30.6  bf16 exact 50.1/49.5/49.6/49.4/53.1
"""
import sys

from specdec.bench.forward import prefilled_cache, time_block
from specdec.models.loading import load

label, folder = sys.argv[1], sys.argv[2]
int8 = load(folder, quantize="int8")
bf16 = load(folder, dtype="bfloat16")
caches = {"int8": prefilled_cache(int8, 1, 64), "bf16 exact": prefilled_cache(bf16, 1, 64)}
times = {"int8": {}, "bf16 exact": {}}
for k in (1, 2, 3, 5, 8):
    times["int8"][k] = round(1000 * time_block(int8, caches["int8"], k, 20), 2)
    times["bf16 exact"][k] = round(1000 * time_block(bf16, caches["bf16 exact"], k, 10), 2)
print(label, times)
