"""`specdec bench-batch`: throughput against batch size. The same N prompts are decoded in
batches of B (N/B generate() calls) for every B, so every batch size does the same work;
tokens/s is all generated tokens over the summed wall time (median of --repeats rounds).
Each batched greedy output is checked against the same prompt decoded alone."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdec.names import help_formatter

if TYPE_CHECKING:
    from specdec.decoder import GenerationResult, SpeculativeDecoder


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


def measure(decoder: SpeculativeDecoder, prompts: list[str], batch: int,
            max_new_tokens: int) -> tuple[float, list[GenerationResult]]:
    """Seconds to decode every prompt in batches of ``batch``; the outputs in prompt order."""
    outputs: list[GenerationResult] = []
    started = time.perf_counter()
    for start in range(0, len(prompts), batch):
        outputs += decoder.generate(prompts[start : start + batch], max_new_tokens=max_new_tokens)
    return time.perf_counter() - started, outputs


def bench_batch(target, draft, prompts: list[str], batch_sizes: list[int], max_new_tokens: int, gamma: int,
                repeats: int, progress=None) -> dict:
    from specdec.bench.suite import machine_description
    from specdec.decoder import SpeculativeDecoder

    methods = {"target-only": SpeculativeDecoder(target)}
    if draft is not None:
        methods[f"model:fixed gamma {gamma}"] = SpeculativeDecoder(target, draft, gamma=gamma)
    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []
    for name, decoder in methods.items():
        decoder.generate(prompts[:2], max_new_tokens=4)  # warm-up
        reference = None
        for batch in batch_sizes:
            times = []
            for _ in range(repeats):
                seconds, outputs = measure(decoder, prompts, batch, max_new_tokens)
                times.append(seconds)
                if progress:
                    progress(f"{name}, batch {batch}")
            ids = [o.token_ids for o in outputs]
            reference = reference or ids
            mismatches += [f"{name}, batch {batch}, prompt {i}"
                           for i, (a, b) in enumerate(zip(ids, reference, strict=True)) if a != b]
            tokens = sum(len(o.token_ids) for o in outputs)
            rows.append(
                {
                    "method": name,
                    "batch": batch,
                    "tokens": tokens,
                    "seconds": statistics.median(times),
                    "tokens_per_second": tokens / statistics.median(times),
                }
            )
    for row in rows:
        single = next(r for r in rows if r["method"] == row["method"] and r["batch"] == batch_sizes[0])
        row["vs_batch_1"] = row["tokens_per_second"] / single["tokens_per_second"]
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_description(),
        "target": target.name,
        "draft": draft.name if draft else None,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "rows": rows,
        "mismatches": mismatches,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["method"] == method]
        axes.plot([r["batch"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o", label=method)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("batch size (requests per step)")
    axes.set_ylabel("generated tokens / s")
    axes.set_title(f"{result['target']}, {result['date'][:10]}", fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args: argparse.Namespace, console, errors, load_models) -> int:
    from rich.table import Table

    from specdec.bench.suite import load_prompts
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
