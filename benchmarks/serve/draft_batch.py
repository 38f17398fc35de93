"""What drafting costs in a batch: the default pair's draft model, gamma 4 (fixed policy), for
batches of 1..32 of the suite's prompts, greedy; per batch size the tokens per second, the draft's
share of the wall time (the sum of each request's draft seconds: a lockstep forward's time is
shared out among its requests) and the draft milliseconds per step. Run it against two checkouts
(PYTHONPATH=...) to compare request-by-request and lockstep drafting side by side.

    python benchmarks/serve/draft_batch.py [--target DIR --draft DIR] [--device cuda] [--dtype D]
        [--batches 1 4 16 32] [--new-tokens 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import specdec
from specdec import SpeculativeDecoder, load
from specdec.bench.suite import machine_description
from specdec.defaults import default_model, default_pair, fastest_default_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--target", help="default: the default pair (with --draft: any pair of folders)")
    parser.add_argument("--draft")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="runs/draft_batch.json")
    args = parser.parse_args()
    if args.target is None:
        path, quantize, line = fastest_default_target(default_pair())
        print(line)
        target, draft = load(path, quantize=quantize), load(default_model("draft"), quantize=quantize)
    else:
        target, draft = (load(folder, dtype=args.dtype, device=args.device) for folder in (args.target, args.draft))
    suite = json.loads((Path(specdec.__file__).parent / "assets/bench_prompts.json").read_text())
    prompts: list = [item["prompt"] for item in suite]
    if target.tokenizer is None:
        prompts = [[(index * 31 + 7 * i) % target.vocab_size for i in range(24)] for index in range(len(prompts))]
    rows = []
    for batch in args.batches:
        batch_prompts = (prompts * (batch // len(prompts) + 1))[:batch]
        row: dict = {"batch": batch}
        for name, decoder in (("off", SpeculativeDecoder(target)),
                              ("on", SpeculativeDecoder(target, draft, gamma=4, policy="fixed"))):
            decoder.generate(batch_prompts[:1], max_new_tokens=4)  # warm
            started = time.perf_counter()
            results = decoder.generate(batch_prompts, max_new_tokens=args.new_tokens)
            seconds = time.perf_counter() - started
            tokens = sum(len(result.token_ids) for result in results)
            steps = max(result.stats.target_forwards for result in results)
            draft_seconds = sum(result.stats.draft_seconds for result in results)
            row[name] = {"tokens_per_s": round(tokens / seconds, 1), "draft_share": round(draft_seconds / seconds, 3),
                         "draft_ms_per_step": round(1000 * draft_seconds / steps, 1), "steps": steps}
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine_description(), "date": time.strftime("%Y-%m-%dT%H:%M"),
                                          "device": str(target.device), "target": target.describe(),
                                          "draft": draft.describe(), "code": specdec.__file__, "rows": rows}, indent=1))
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
