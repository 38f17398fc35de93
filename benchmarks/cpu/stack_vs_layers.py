"""T(k) of a packed own forward with its decoder layers in one compiled call (layer_stack.py) and
one by one, alternated in one process (the VM's speed drifts between runs): median ms per k-token
block after a cached context, per round, with a table and JSON.

    python benchmarks/cpu/stack_vs_layers.py DIR_OR_GGUF --quantize int4 --blocks 1,4,8,16 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdec.models.loading import load
from specdec.models.timing import prefilled_cache, time_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--backend", default="specdec")
    parser.add_argument("--blocks", default="1,4,8,16")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10, help="forwards a median is taken over")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = load(args.model, quantize=args.quantize, backend=args.backend)
    network = model.network
    stack = network.layer_stack
    if stack is None:
        raise SystemExit(f"{model.name} has no one-call stack here ({network.quantize_notice})")
    blocks = [int(block) for block in args.blocks.split(",")]
    ways = {"one call": stack, "per layer": None}
    times: dict[str, dict[int, list[float]]] = {way: {block: [] for block in blocks} for way in ways}
    for _ in range(args.rounds):
        for way, setting in ways.items():
            network.layer_stack = setting
            for block in blocks:
                cache = prefilled_cache(model, 1, args.context)
                time_block(model, cache, block, 2)  # warm-up
                times[way][block].append(time_block(model, cache, block, args.repeats) * 1000)
    network.layer_stack = stack
    table = Table(title=f"{model.name} {model.precision}: T(k) ms, median of {args.rounds} rounds")
    table.add_column("k")
    for way in ways:
        table.add_column(way)
    table.add_column("per layer / one call")
    summary = {}
    for block in blocks:
        medians = {way: statistics.median(times[way][block]) for way in ways}
        summary[block] = medians
        table.add_row(str(block), *[f"{medians[way]:.2f}" for way in ways],
                      f"{medians['per layer'] / medians['one call']:.3f}")
    Console().print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": args.model, "precision": model.precision, "times": times,
                                        "medians": summary}, indent=1))


if __name__ == "__main__":
    main()
