"""Bundled pair, fp32: exact vs inexact target, side by side (usage: python exact_bundled.py PROMPTS_PER_CATEGORY;
the 302 vs 424 tok/s in docs/design.md came from 4)."""
import sys

from specdec.bench.runner import markdown_table, run_side_by_side, speculative_method, summarize
from specdec.bench.suite import load_prompts
from specdec.core.sampling import SamplingParams
from specdec.decoder import SpeculativeDecoder
from specdec.defaults import default_model, default_prompts
from specdec.drafting import make_drafter
from specdec.models.loading import load

targets = {"exact": load(default_model("target")), "plain": load(default_model("target"), exact=False)}
draft = load(default_model("draft"))
methods = []
for kind, target in targets.items():
    methods += [
        speculative_method(f"{kind} target-only", SpeculativeDecoder(target)),
        speculative_method(f"{kind} model:fixed", SpeculativeDecoder(target, make_drafter("model", draft), gamma=4)),
        speculative_method(
            f"{kind} ngram:threshold",
            SpeculativeDecoder(target, make_drafter("ngram", None), gamma=4, policy="threshold"),
        ),
    ]
prompts = load_prompts(default_prompts(), int(sys.argv[1]))
run = run_side_by_side(
    methods,
    prompts,
    targets["exact"].tokenizer.encode,
    SamplingParams(max_new_tokens=64),
    "exact target-only",
    repeats=3,
    references={"specdec": "exact target-only"},
)
print(markdown_table(summarize(run.measurements, ["exact target-only", "plain target-only"])))
print("mismatches:", [str(m) for m in run.mismatches])
