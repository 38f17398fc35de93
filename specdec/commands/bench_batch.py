"""`specdec bench-batch`: batched decoding at several batch sizes (specdec.bench.batch)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec.bench.batch import bench_batch, plot
from specdec.names import help_formatter


def add_parser(commands, add_model_options) -> None:
    parser = commands.add_parser("bench-batch", help="throughput against batch size (target-only and speculative)",
                                 formatter_class=help_formatter())
    add_model_options(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompts", help="JSON prompt file (default: the bundled suite)")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts decoded at every batch size")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4, help="draft length of the speculative method")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="runs/bench-batch")


def run(args: argparse.Namespace, console, errors) -> int:
    from rich.table import Table

    from specdec.bench.suite import load_prompts
    from specdec.commands.models import load_models
    from specdec.defaults import default_prompts

    if min(args.batch_sizes) < 1 or args.num_prompts < 1 or args.repeats < 1:
        raise ValueError("--batch-sizes, --num-prompts and --repeats must be positive")
    target, draft = load_models(args, errors)
    suite = load_prompts(Path(args.prompts) if args.prompts else default_prompts())
    prompts = [suite[i % len(suite)].text for i in range(args.num_prompts)]
    with errors.status("bench-batch") as status:
        result = bench_batch(
            target,
            draft,
            prompts,
            sorted(set(args.batch_sizes)),
            args.max_new_tokens,
            args.gamma,
            args.repeats,
            progress=lambda label: status.update(f"bench-batch: {label}"),
        )
    table = Table(title=f"throughput vs batch size: {result['target']}, {result['machine']}, {result['date']}")
    for column in ("method", "batch", "tokens/s", "vs batch 1"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in result["rows"]:
        table.add_row(row["method"], str(row["batch"]), f"{row['tokens_per_second']:.1f}", f"{row['vs_batch_1']:.2f}x")
    console.print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "batch.png")
    errors.print(f"wrote {out / 'batch.json'} and {out / 'batch.png'}")
    if result["mismatches"]:
        errors.print(
            f"[red]batched greedy output differs from batch {args.batch_sizes[0]}:[/] "
            + "; ".join(result["mismatches"][:5])
        )
        return 1
    return 0
