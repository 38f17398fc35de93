"""Draft seconds per step as a function of the drafted length (staged and model drafters, real int8 pair)."""
import collections
import sys

import torch

from specdec import SpeculativeDecoder, load
from specdec.core.policy import make_policy
from specdec.drafting import make_drafter

torch.set_num_threads(2)
M = sys.argv[1] if len(sys.argv) > 1 else "/work/models"
target = load(f"{M}/qwen2.5-coder-1.5b", quantize="int8")
draft = load(f"{M}/qwen2.5-coder-0.5b", quantize="int8")
prompt = (
    "Write a Python function that parses a CSV file and returns a list of dicts, with type hints and a docstring.\n"
)
for kind in ("model", "staged"):
    for gamma in (1, 2, 4, 8):
        policy = make_policy("fixed", gamma)
        seen = collections.defaultdict(list)
        cls = type(policy)
        orig = cls.update

        def update(self, asked, num_drafted, num_accepted, draft_seconds, verify_seconds, widths=None, _orig=orig,
                   _seen=seen):
            _seen[num_drafted].append(draft_seconds)
            return _orig(self, asked, num_drafted, num_accepted, draft_seconds, verify_seconds, widths)

        cls.update = update
        dec = SpeculativeDecoder(target, make_drafter(kind, draft), gamma=gamma, policy=policy)
        r = dec.generate(prompt, max_new_tokens=48)
        cls.update = orig
        print(
            kind,
            gamma,
            {k: (len(v), round(1000 * sum(v[1:]) / max(1, len(v) - 1), 1)) for k, v in sorted(seen.items())},
            flush=True,
        )
