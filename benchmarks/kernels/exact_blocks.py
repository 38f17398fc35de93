"""Price of exact float verify blocks (usage: python exact_blocks.py MODEL_DIR DTYPE 1,2,5,8 8,16): T(k)
with linears in calls of fixed rows (and per-query attention) vs the plain forward, alternated in one process;
plus max |block - alone| logits."""

import datetime
import json
import sys

import torch

from specdec.bench.forward import prefilled_cache, time_block
from specdec.bench.suite import machine_description
from specdec.models.base import Attention, Segment
from specdec.models.loading import load

model = load(sys.argv[1], dtype=sys.argv[2])
net = model.network
modes = {"plain": None, **{f"fixed{r}": r for r in map(int, sys.argv[4].split(","))}}


def use(rows):
    net.fixed_rows = rows


def drift(k):
    torch.manual_seed(k)
    prefix, block = torch.randint(0, 5000, (64,)), torch.randint(0, 5000, (k,))
    c1, c2 = model.new_cache(), model.new_cache()
    model.extend(prefix, c1, 0)
    model.extend(prefix, c2, 0)
    pos = torch.arange(64, 64 + k)
    blk = model.forward(block, pos, c1, Attention((Segment(0, k),))).logits
    rows = []
    for i in range(k):
        rows.append(model.forward(block[i : i + 1], pos[i : i + 1], c2, Attention((Segment(0, 1),))).logits[0])
        c2.commit(0, 1)
    return (blk.float() - torch.stack(rows).float()).abs().max().item()


for name, rows in modes.items():
    use(rows)
    print(name, "max |block - alone| for k=5, 9:", drift(5), drift(9), flush=True)
cache = prefilled_cache(model, 1, 64)
blocks = [int(b) for b in sys.argv[3].split(",")]
res = {name: {} for name in modes}
for k in blocks:
    for name, rows in modes.items():
        use(rows)
        time_block(model, cache, k, 1)
        res[name][k] = time_block(model, cache, k, 3) * 1e3
    print(k, {n: round(v[k], 1) for n, v in res.items()}, flush=True)
print(
    json.dumps(
        {"date": datetime.datetime.now().isoformat(), "machine": machine_description(), "dtype": sys.argv[2], "ms": res}
    )
)
