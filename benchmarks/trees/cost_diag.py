"""Which gammas does the cost policy pick on the real int8 pair, and what T(k) did it measure?"""
import collections
import sys

import torch

from specdec import SpeculativeDecoder, load
from specdec.core.policy import make_policy
from specdec.drafting import make_drafter

torch.set_num_threads(2)
M = sys.argv[1] if len(sys.argv) > 1 else "/work/models"  # the folder ../shared/real-models/fetch.sh filled
target = load(f"{M}/qwen2.5-coder-1.5b", quantize="int8")
draft = load(f"{M}/qwen2.5-coder-0.5b", quantize="int8")
policy = make_policy("cost", 4)
chosen = collections.Counter()
orig = type(policy).for_request
def spy(self):
    p = orig(self)
    next_shape = p.next_shape
    def counted_shape(batch=1):
        shape = next_shape(batch); chosen[shape.depth] += 1; return shape
    p.next_shape = counted_shape
    spy.last = p
    return p
type(policy).for_request = spy
dec = SpeculativeDecoder(target, make_drafter("staged", draft), gamma=4, policy=policy)
prompt = (
    "Write a Python function that parses a CSV file and returns a list of dicts, with type hints and a docstring.\n"
)
for _ in range(2):
    r = dec.generate(prompt, max_new_tokens=64)
    p = spy.last
    print("gammas", sorted(chosen.items()))
    chosen.clear()
    print(
        "T(k) ms",
        {k: round(m.mean * 1000, 1) for k, m in sorted(p.verify_cost.by_block.items())},
        "counts",
        {k: round(m.count, 1) for k, m in sorted(p.verify_cost.by_block.items())},
    )
    print("fit ms", {k: round(p.verify_cost.seconds(k) * 1000, 1) for k in range(1, 14)})
    print(
        "draft ms/token", round(p.draft_cost.mean * 1000, 1), "acceptance", [round(a, 2) for a in p.acceptance.alphas()]
    )
    print("rates", {g: round(p.expected_rate(g) or 0, 2) for g in range(0, 13)})
