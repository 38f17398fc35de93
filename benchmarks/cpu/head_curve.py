"""A draft head's learning curve: heads trained on growing shares of one data plan (windows and
continuations apart), each scored on the plan's held-out set by depth. Every point is a
`specdec train-head` run with --train-windows / --train-continuations in its own folder, all
sharing one feature cache, so the whole curve is resumable: run the same command again after a
stop (--hours, or a session's end) and it goes on where it stopped, the points done read back.

    python benchmarks/cpu/head_curve.py --target $M/qwen2.5-coder-1.5b --quantize int4 \\
        --features /work/runs/head-81/features --out /work/runs/curve --data stdlib site-packages \\
        --corpus-sequences 8000 --continuation-sequences 8192 --heldout-sequences 64 \\
        --points 1024:0 2048:0 4096:0 0:1024 0:2048 --steps 2000 [--draft-vocab 16384] [--hours H]

A point W:C trains on the first W windows and C continuations' prompts (whole saved parts). Prints
a table; after every point, OUT/curve.json and OUT/curve.png (held-out top-1 by depth against the
tokens trained on, windows and continuations apart) hold the points scored so far.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from head_heldout import heldout_agreement  # (this folder: the script's own path comes first)
from rich.console import Console
from rich.table import Table

from specdec import load
from specdec.training.budget import BudgetSpent
from specdec.training.head_settings import HeadTraining
from specdec.training.head_train import data_plan, target_output_rows, train_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--features", required=True, help="the feature cache every point shares (made if missing)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", nargs="+", default=["stdlib"])
    parser.add_argument("--points", nargs="+", required=True, help="W:C, windows and continuations' prompts")
    parser.add_argument("--hours", type=float, help="for the whole curve; the same command goes on after a stop")
    defaults = HeadTraining(out="")
    for name in ("corpus_sequences", "continuation_sequences", "heldout_sequences", "steps", "draft_vocab",
                 "batch_size", "ttt_steps", "sequence_length", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--intermediate-size", type=int)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    args = parser.parse_args()
    target = load(args.target, quantize=None if args.quantize == "none" else args.quantize)
    rows = target_output_rows(target)
    features, out = Path(args.features), Path(args.out)
    features.mkdir(parents=True, exist_ok=True)
    started, results = time.perf_counter(), []
    console = Console(stderr=True)
    for point in args.points:
        windows, continuations = (int(count) for count in point.split(":"))
        folder = out / f"w{windows}-c{continuations}"
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "features").exists():
            (folder / "features").symlink_to(features.resolve(), target_is_directory=True)
        left = None if args.hours is None else args.hours - (time.perf_counter() - started) / 3600
        settings = HeadTraining(
            out=str(folder), data=tuple(args.data), draft_vocab=args.draft_vocab, steps=args.steps,
            ttt_steps=args.ttt_steps, sequence_length=args.sequence_length,
            corpus_sequences=args.corpus_sequences, continuation_sequences=args.continuation_sequences,
            heldout_sequences=args.heldout_sequences, batch_size=args.batch_size,
            learning_rate=args.learning_rate, intermediate_size=args.intermediate_size,
            eval_every=max(args.steps // 4, 1), checkpoint_every=50, seed=args.seed,
            train_windows=windows, train_continuations=continuations, hours=left,
            command=f"benchmarks/cpu/head_curve.py point {point}")
        console.print(f"point {point}: {folder}")
        try:
            head = train_head(target, settings, console)
        except BudgetSpent as stopped:
            console.print(f"stopped at point {point}: {stopped}; run the same command again to go on")
            break
        heldout = features / data_plan(target, settings).key() / "heldout.safetensors"
        scores = heldout_agreement(target, str(head), str(heldout), rows=rows)
        trained = json.loads((head / "training.json").read_text())  # whole parts: the share rounded up
        results.append({"point": point, "sequences": trained["sequences"], "tokens": trained["tokens"], **scores})
        console.print(f"point {point}: {json.dumps(results[-1])}")
        # saved after every point: a curve stopped part way (--hours, a session's end) keeps the points it scored
        (out / "curve.json").write_text(json.dumps({"settings": vars(args), "points": results}, indent=1))
        plot_curve(results, out / "curve.png", f"{Path(args.target).name}, {args.steps} steps a point")
    table = Table("point", "tokens trained on", "held-out windows top-1 by depth", "continuations")
    for result in results:
        table.add_row(result["point"], f"{result['tokens']:,}",
                      " / ".join(f"{a:.3f}" for a in result.get("library", [])),
                      " / ".join(f"{a:.3f}" for a in result.get("continuations", [])))
    Console().print(table)


def plot_curve(results: list[dict], path: Path, subtitle: str) -> None:
    """Held-out top-1 at each depth against the tokens a point trained on, windows and
    continuations in two panels; each point's W:C beside its marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(results, key=lambda result: result["tokens"])
    figure, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for axis, (held_out, title) in zip(axes, (("library", "held-out library windows"),
                                              ("continuations", "held-out target continuations")), strict=True):
        scored = [result for result in ordered if result.get(held_out)]
        if not scored:  # (a plan without continuations holds none out)
            axis.text(0.5, 0.5, "none in this plan", ha="center", va="center", transform=axis.transAxes)
        for depth in range(max((len(result[held_out]) for result in scored), default=0)):
            axis.plot([result["tokens"] for result in scored], [result[held_out][depth] for result in scored],
                      marker="o", label=f"depth {depth + 1}")
        for result in scored:
            axis.annotate(result["point"], (result["tokens"], result[held_out][0]), fontsize=7,
                          textcoords="offset points", xytext=(0, 6), ha="center")
        axis.set_xscale("log")
        axis.set_xlabel("tokens trained on")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("top-1 agreement with the target")
    axes[0].legend(fontsize=8)
    figure.suptitle(f"draft head learning curve: {subtitle}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
