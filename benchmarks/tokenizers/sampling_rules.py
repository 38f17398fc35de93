"""Acceptance of the two cross-vocabulary sampling rules on the same prompts and seeds (counts,
not timings): SmolLM2-135M-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (int8), gamma 5.
Run: python benchmarks/tokenizers/sampling_rules.py MODELS_DIR OUT.json"""

import json
import sys
from pathlib import Path

from specdec import SamplingParams, SpeculativeDecoder, load
from specdec.bench.suite import load_prompts
from specdec.defaults import default_prompts
from specdec.drafting import TranslatingDrafter

models, out = Path(sys.argv[1]), Path(sys.argv[2])
target = load(models / "qwen2.5-coder-1.5b", quantize="int8")
draft = load(models / "smollm2-135m", quantize="int8")
prompts = [p.text for p in load_prompts(default_prompts(), per_category=1)]
rows = {}
for rule in ("intersection", "point-mass"):
    decoder = SpeculativeDecoder(target, TranslatingDrafter(draft, target, vocab_rule=rule), gamma=5)
    totals = dict(drafted=0, accepted=0, generated=0, forwards=0)
    for seed in range(3):
        for prompt in prompts:
            stats = decoder.generate(prompt, SamplingParams(temperature=0.8, seed=seed, max_new_tokens=48)).stats
            totals["drafted"] += stats.drafted
            totals["accepted"] += stats.accepted
            totals["generated"] += stats.generated_tokens
            totals["forwards"] += stats.target_forwards
    rows[rule] = {
        **totals,
        "alpha": totals["accepted"] / totals["drafted"],
        "tau": totals["generated"] / totals["forwards"],
    }
    print(rule, rows[rule], flush=True)
out.write_text(
    json.dumps(
        {"prompts": len(prompts), "seeds": 3, "temperature": 0.8, "max_new_tokens": 48, "gamma": 5, "rules": rows},
        indent=1,
    )
)
