"""The chart of a `specdec bench` run: tokens per second of every method, tau and pass@1 on each bar."""

from __future__ import annotations

from pathlib import Path

from specdec.bench.runner import REFERENCE


def plot_summaries(summaries, path: Path, subtitle: str) -> None:
    """Tokens per second of every method (all prompts), with tau printed on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in summaries if s.category == "all"]
    figure, axis = plt.subplots(figsize=(max(6, 0.8 * len(rows) + 2), 4.5))
    colours = ["#888888" if s.method == REFERENCE else "#4c72b0" if s.engine == "specdec" else "#dd8452"
               for s in rows]
    bars = axis.bar([s.method for s in rows], [s.tokens_per_second for s in rows], color=colours)
    for bar, summary in zip(bars, rows, strict=True):
        tau = summary.to_dict()["tau"]
        label = f"{summary.speedups.get(REFERENCE, 0):.2f}x" + (f"\ntau {tau:.2f}" if tau else "") + (
            f"\npass@1 {summary.pass_at_1:.2f}" if summary.checked else "")
        axis.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                      fontsize=8)
    from matplotlib.patches import Patch

    room = 1.35 if any(s.checked for s in rows) else 1.25  # for the labels above the bars
    axis.set_ylim(0, room * max((s.tokens_per_second for s in rows), default=1))
    legend = [
        Patch(color="#888888", label=f"{REFERENCE} (reference)"),
        Patch(color="#4c72b0", label="specdec speculative"),
        Patch(color="#dd8452", label="other engines"),
    ]
    shown = {matplotlib.colors.to_rgb(colour) for colour in colours}
    axis.legend(handles=[patch for patch in legend if patch.get_facecolor()[:3] in shown], fontsize=8, loc="upper left")
    axis.set_ylabel("tokens per second")
    axis.set_title(f"specdec bench: {subtitle}", fontsize=10)
    axis.tick_params(axis="x", rotation=45)
    for tick in axis.get_xticklabels():
        tick.set_horizontalalignment("right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
