"""What speculation can give on a target, from its measured verify blocks (t_of_k.py's JSON): for
each configuration, T(k) / T(1) and the best chain speedup over target-only (estimates.speedup_ceiling)
with every draft accepted and free (no drafter beats it), with every draft accepted at the drafter's
cost, and with the drafter's measured reach (head_acceptance.py's reach_depth) at that cost.

    python benchmarks/cpu/ceiling.py docs/benchmarks/archive/cpu/t_of_k-qwen15-w8a32-zen1-avx2.json \\
        --reach 0.551 0.371 0.244 0.137 --draft-fraction 0.05 [--out runs/ceiling.json]
"""

import argparse
import json
from pathlib import Path

from specdec.core.estimates import speedup_ceiling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measurements", nargs="+", help="t_of_k.py JSON files")
    parser.add_argument("--reach", nargs="+", type=float, help="share of steps accepted past depth 1, 2, ...")
    parser.add_argument("--draft-fraction", type=float, default=0.0, help="a draft token's cost over T(1)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for path in args.measurements:
        measured = json.loads(Path(path).read_text())
        for row in measured["rows"]:
            seconds = {int(k): ms / 1e3 for k, ms in row["ms"].items()}
            cases = {"perfect, free": speedup_ceiling(seconds),
                     "perfect, drafting": speedup_ceiling(seconds, draft_fraction=args.draft_fraction)}
            if args.reach:
                cases["measured reach"] = speedup_ceiling(seconds, args.reach, args.draft_fraction)
            rows.append({"file": path, "date": measured.get("date"), "isa": measured.get("isa"),
                         "config": row["config"],
                         "t_over_t1": {k: round(s / seconds[1], 3) for k, s in sorted(seconds.items())},
                         "ceiling": {name: {"gamma": gamma, "speedup": round(speedup, 3)}
                                     for name, (gamma, speedup) in cases.items()}})
            ratios = " ".join(f"{k}:{r:.2f}" for k, r in rows[-1]["t_over_t1"].items())
            best = "  ".join(f"{name} {speedup:.2f}x (gamma {gamma})" for name, (gamma, speedup) in cases.items())
            print(f"{Path(path).stem} {row['config']:14s} T(k)/T(1) {ratios} | {best}")
    if args.out:
        Path(args.out).write_text(json.dumps({"draft_fraction": args.draft_fraction, "reach": args.reach,
                                              "rows": rows}, indent=1))
        print(f"-> {args.out}")


if __name__ == "__main__":
    main()
