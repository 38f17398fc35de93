"""T(1) of several models alternated in one process (the VM's speed drifts 10-20% within minutes,
so two models are compared only side by side): each model int4 (or --quantize), after 64 cached
tokens, rounds of 10 one-token forwards, the median of each round; prints the median of rounds.

    python benchmarks/cpu/alternate_t1.py DIR [DIR ...] [--quantize int4] [--rounds 8]
"""

import argparse
import gc
import statistics
from pathlib import Path

from specdec.models import load
from specdec.models.timing import prefilled_cache, time_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    models = {}
    for path in args.models:
        models[Path(path).name] = load(path, quantize=args.quantize)
        gc.collect()
    caches = {name: prefilled_cache(model, 1, 64) for name, model in models.items()}
    for name, model in models.items():
        time_block(model, caches[name], 1, 5)  # warm-up
    rounds: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            rounds[name].append(time_block(model, caches[name], 1, 10) * 1e3)
    for name, samples in rounds.items():
        print(f"{name}: T(1) {statistics.median(samples):.1f} ms (rounds: {', '.join(f'{s:.1f}' for s in samples)})")


if __name__ == "__main__":
    main()
