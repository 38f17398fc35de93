#!/usr/bin/env bash
# Single-request speed of two checkouts of specdec on the same models, prompts and machine:
# runs `specdec bench` from OLD and NEW alternately (ROUNDS times each) and prints each run's
# summary line. Usage:
#   benchmarks/compare_checkouts.sh OLD_DIR NEW_DIR OUT_DIR ROUNDS -- [specdec bench args...]
# Each checkout runs with its own sources on PYTHONPATH and the same python (the current venv).
set -euo pipefail
OLD=$1; NEW=$2; OUT=$3; ROUNDS=$4; shift 4; [ "${1:-}" = "--" ] && shift
mkdir -p "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    dir=$OLD; [ $side = new ] && dir=$NEW
    echo "== round $round: $side ($dir)" >&2
    (cd "$dir" && PYTHONPATH="$dir" python -m specdec bench "$@" --out "$OUT/$side-$round") \
      > "$OUT/$side-$round.log" 2>&1
  done
done
python - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
rates = {}
for side in ("old", "new"):
    for r in range(1, rounds + 1):
        data = json.loads((out / f"{side}-{r}" / "results.json").read_text())
        for summary in data["summaries"]:
            if summary["category"] is None or summary["category"] == "all":
                rates.setdefault((side, summary["method"]), []).append(summary["tokens_per_second"])
methods = sorted({m for _, m in rates})
print(f"{'method':32} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8}")
for m in methods:
    old, new = statistics.median(rates[("old", m)]), statistics.median(rates[("new", m)])
    print(f"{m:32} {old:10.2f} {new:10.2f} {new / old:8.3f}")
PY
