"""Coupled vs rejection sampling, side by side: acceptance, tau and tok/s of each method under each
rule, at each temperature, on the same prompts and seeds (interleaved per prompt, so both rules see
the machine's noise alike). Under the coupled rule every method's text must equal the target
alone's with the same seed: the script checks it and reports any difference.

    python benchmarks/cpu/sampling_rules.py [--target DIR --draft DIR] [--head DIR]
        [--methods target ngram:cost model:fixed head:cost] [--temperatures 0.8 1.0]
        [--per-category 2] [--max-new-tokens 64] [--repeats 1] [--out FILE.json]

Default models: the default pair (its int8 target, its draft and shipped head).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.bench.suite import load_prompts
from specdec.core.sampling import SAMPLING_RULES
from specdec.defaults import default_pair, default_prompts
from specdec.machine import isa_summary, write_measurement


def build_decoders(methods: list[str], target, draft, head, gamma: int) -> dict[str, SpeculativeDecoder]:
    decoders = {}
    for method in methods:
        if method == "target":
            decoders[method] = SpeculativeDecoder(target)
            continue
        kind, _, policy = method.partition(":")
        drafter = make_drafter(kind, draft, target=target, head=head)
        decoders[method] = SpeculativeDecoder(target, drafter, gamma=gamma, policy=policy or "fixed")
    return decoders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--head", help="an EAGLE-3 head folder for head methods (default: the default pair's)")
    parser.add_argument("--quantize", default="int8", choices=["int8", "none"])
    parser.add_argument("--methods", nargs="+", default=["target", "ngram:cost", "model:fixed", "head:cost"])
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.8, 1.0])
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", default="runs/sampling-rules.json")
    args = parser.parse_args()
    pair = default_pair()
    target_path = args.target or str(pair.target)
    draft_path = args.draft or str(pair.draft)
    head = args.head or (pair.head if args.target is None else None)
    quantize = None if args.quantize == "none" else args.quantize
    target, draft = load(target_path, quantize=quantize), load(draft_path, quantize=quantize)
    methods = [m for m in args.methods if not m.startswith("head") or head is not None]
    decoders = build_decoders(methods, target, draft, head, args.gamma)
    prompts = load_prompts(default_prompts(), args.per_category)
    # (temperature, method, rule) -> totals
    totals: dict = defaultdict(lambda: {"tokens": 0, "seconds": 0.0, "accepted": 0, "drafted": 0, "forwards": 0})
    mismatches = []
    for decoder in decoders.values():  # warm-up: the first calls pay one-time costs
        decoder.generate(prompts[0].text, max_new_tokens=4)
    for index, prompt in enumerate(prompts):
        for temperature in args.temperatures:
            texts = {}
            for rule in SAMPLING_RULES:
                for method, decoder in decoders.items():
                    sampling = SamplingParams(temperature=temperature, seed=index, sampling_rule=rule,
                                              max_new_tokens=args.max_new_tokens)
                    timings = []
                    for _ in range(args.repeats):
                        started = time.perf_counter()
                        result = decoder.generate(prompt.text, sampling)
                        timings.append(time.perf_counter() - started)
                    cell = totals[(temperature, method, rule)]
                    cell["tokens"] += len(result.token_ids)
                    cell["seconds"] += statistics.median(timings)
                    cell["accepted"] += result.stats.accepted
                    cell["drafted"] += result.stats.drafted
                    cell["forwards"] += result.stats.target_forwards
                    texts[(method, rule)] = result.token_ids
            for method in decoders:
                if texts[(method, "coupled")] != texts[("target", "coupled")]:
                    mismatches.append({"prompt": prompt.id, "temperature": temperature, "method": method})
        print(f"[{index + 1}/{len(prompts)}] {prompt.id}", flush=True)
    rows = []
    for (temperature, method, rule), cell in totals.items():
        baseline = totals[(temperature, "target", "rejection")]
        speed = cell["tokens"] / cell["seconds"]
        rows.append({"temperature": temperature, "method": method, "rule": rule, **cell,
                     "alpha": cell["accepted"] / cell["drafted"] if cell["drafted"] else None,
                     "tau": cell["tokens"] / cell["forwards"], "tokens_per_second": speed,
                     "speedup": speed / (baseline["tokens"] / baseline["seconds"])})
    print("| temperature | method | rule | alpha | tau | tok/s | x target (rejection) |\n|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["temperature"], r["method"], r["rule"])):
        alpha = "-" if row["alpha"] is None else f"{row['alpha']:.3f}"
        print(f"| {row['temperature']} | {row['method']} | {row['rule']} | {alpha} | {row['tau']:.2f} | "
              f"{row['tokens_per_second']:.1f} | {row['speedup']:.2f} |")
    print(f"coupled outputs equal to the target alone's: {'yes' if not mismatches else mismatches}")
    write_measurement(args.out, {"target": target.name, "draft": draft.name, "quantize": args.quantize,
                                 "head": str(head) if head else None, "gamma": args.gamma,
                                 "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                                 "repeats": args.repeats, "rows": rows, "coupled_mismatches": mismatches})
    print(f"wrote {args.out} ({isa_summary()})")


if __name__ == "__main__":
    main()
