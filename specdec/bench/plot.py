"""The charts of a `specdec bench` run: tokens per second of every method, tau and pass@1 on each bar;
where outputs were tested (HumanEval), pass@1 against tokens per second."""

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


def plot_speed_against_pass_at_1(summaries, path: Path, subtitle: str) -> bool:
    """pass@1 (y) against tokens per second (x), a point per tested method (all prompts), lossy
    methods (``@scheme``) joined to the exact method they relax: each scheme's price in quality
    beside what it buys in speed. False (nothing written) where no method's outputs were tested."""
    rows = [s for s in summaries if s.category == "all" and s.checked]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    by_method = {s.method: s for s in rows}
    for order, summary in enumerate(sorted(rows, key=lambda s: (s.pass_at_1, s.tokens_per_second))):
        base = summary.method.split("@")[0]
        exact = by_method.get(base)
        if exact is not None and exact is not summary:  # a lossy setting: a line from its exact method
            axis.plot([exact.tokens_per_second, summary.tokens_per_second], [exact.pass_at_1, summary.pass_at_1],
                      color="#bbbbbb", linewidth=1, zorder=1)
        colour = "#888888" if summary.method == REFERENCE else "#c44e52" if "@" in summary.method else "#4c72b0"
        axis.scatter(summary.tokens_per_second, summary.pass_at_1, color=colour, zorder=2)
        axis.annotate(f"{summary.method} ({summary.passed}/{summary.checked})",
                      (summary.tokens_per_second, summary.pass_at_1), fontsize=7,
                      xytext=(4, 3 if order % 2 else -10), textcoords="offset points")  # neighbours alternate
    speeds = [s.tokens_per_second for s in rows]
    axis.set_xlim(0.9 * min(speeds), 1.25 * max(speeds))  # room for the labels on the right
    axis.set_xlabel("tokens per second")
    axis.set_ylabel("pass@1")
    axis.set_title(f"speed and pass@1: {subtitle}", fontsize=10)
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
