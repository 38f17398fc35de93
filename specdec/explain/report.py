"""`specdec explain --html`: a self-contained page (no network) with every step's view, plots of
acceptance per position and tau over the run, and the expected speedup for each gamma from the
run's measured alpha and c with the measured point marked."""

from __future__ import annotations

import base64
import html
import io
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.core.metrics import SpecStats
from specdec.explain.calculator import speedup_table
from specdec.explain.lossless import LosslessCheck
from specdec.explain.record import RecordedRun, StepRecord, chosen_step
from specdec.explain.steps import StepView, TopToken, step_view, token_text

STYLE = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}
td.n{text-align:right;font-family:monospace}.bar{display:inline-block;height:10px;background:#4a90d9}
.accepted,.on{color:#1a7f37}.rejected{color:#c00;font-weight:bold}.not,.off{color:#999}
details{margin:.4em 0;border:1px solid #ddd;padding:.3em .6em}summary{cursor:pointer}
.charts{display:flex;flex-wrap:wrap;gap:2em}img{max-width:100%}pre{white-space:pre-wrap;background:#f6f6f6;padding:.6em}.mask{font-family:monospace}"""


@dataclass(frozen=True)
class RunCosts:
    """What the speedup curve needs, measured on the run (Leviathan et al.'s alpha and c)."""

    alpha: float  # accepted / (accepted + rejections): each reached draft kept with probability alpha
    c: float | None  # a drafted token's time over the target's one-token forward (None: no baseline)
    verify_ratio: float | None  # the verify forward's time over a one-token forward
    measured_speedup: float | None  # tokens per second over the target alone's, this prompt


def run_costs(run: RecordedRun, baseline: SpecStats | None) -> RunCosts:
    """alpha from the counts; c and the verify ratio from median step times (the first step
    warms caches up) over the target alone's mean time per forward."""
    chains = [record for record in run.records if record.parents is None and record.gamma]
    accepted = sum(record.num_accepted for record in chains)
    rejections = sum(record.rejected for record in chains)
    alpha = accepted / (accepted + rejections) if accepted + rejections else 0.0
    if baseline is None or not baseline.target_forwards or not chains:
        return RunCosts(alpha, None, None, None)
    one_token_ms = baseline.verify_seconds / baseline.target_forwards * 1000
    c = statistics.median(record.draft_ms / record.gamma for record in chains) / one_token_ms
    verify_ratio = statistics.median(record.verify_ms for record in chains) / one_token_ms
    return RunCosts(alpha, c, verify_ratio, run.result.stats.tokens_per_second / baseline.tokens_per_second)


def figure_tag(figure, alt: str) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(figure)
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def run_figures(run: RecordedRun, costs: RunCosts, gamma: int) -> dict[str, Any]:
    """matplotlib figures by name: acceptance per position, tau over the run, and (with the
    target alone timed) expected speedup vs gamma with the measured point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = run.result.stats
    figures = {}
    figure, axes = plt.subplots(figsize=(5, 3))
    positions = range(1, len(stats.acceptance_by_position) + 1)
    axes.bar(positions, stats.acceptance_by_position, color="#4a90d9")
    axes.set(xlabel="draft position", ylabel="accepted share", title="acceptance per position", ylim=(0, 1))
    figures["acceptance per position"] = figure

    figure, axes = plt.subplots(figsize=(5, 3))
    steps = [record.index for record in run.records]
    emitted = [len(record.emitted) for record in run.records]
    running = [sum(emitted[: i + 1]) / (i + 1) for i in range(len(emitted))]
    axes.bar(steps, emitted, color="#cfe0f3", label="tokens this step")
    axes.plot(steps, running, color="#c00", label="tau so far")
    axes.set(xlabel="step", ylabel="tokens", title=f"tau over the run (final {stats.tau:.2f})")
    axes.legend()
    figures["tau over the run"] = figure

    if costs.c is not None and costs.verify_ratio is not None and costs.measured_speedup is not None:  # all or none
        rows = speedup_table(costs.alpha, costs.c, max(10, gamma), [costs.verify_ratio])
        figure, axes = plt.subplots(figsize=(5, 3))
        axes.plot([r.gamma for r in rows], [r.speedup for r in rows], marker=".",
                  label=f"expected: alpha {costs.alpha:.2f}, c {costs.c:.3f}, verify {costs.verify_ratio:.2f}")
        axes.plot([gamma], [costs.measured_speedup], "r*", markersize=12, label=f"measured at gamma {gamma}")
        axes.axhline(1.0, color="#999", linewidth=0.8)
        axes.set(xlabel="gamma", ylabel="speedup over the target alone", title="expected speedup vs gamma")
        axes.legend(fontsize=8)
        figures["expected speedup vs gamma"] = figure
    return figures


def plots(run: RecordedRun, costs: RunCosts, gamma: int) -> list[str]:
    return [figure_tag(figure, name) for name, figure in run_figures(run, costs, gamma).items()]


def lossless_figure(check: LosslessCheck, tokenizer: Any):
    """p next to the shares of the first emitted token over the re-runs, top 10 tokens of p."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = check.p.topk(10).indices.tolist()
    shares = (check.counts.double() / check.seeds)[tokens].tolist()
    figure, axes = plt.subplots(figsize=(7, 3))
    where = list(range(len(tokens)))
    axes.bar([x - 0.2 for x in where], [float(check.p[t]) for t in tokens], 0.4, label="p (the target)")
    axes.bar([x + 0.2 for x in where], shares, 0.4, label=f"first emitted token, {check.seeds} re-runs")
    axes.set_xticks(where, [token_text(tokenizer, t) for t in tokens], rotation=45, fontsize=8)
    axes.set(ylabel="probability", title=f"re-running one step's verification: chi-square p-value {check.p_value:.2f}")
    axes.legend(fontsize=8)
    return figure


def bars_html(title: str, tokens: list[TopToken], tokenizer: Any) -> str:
    rows = "".join(f"<tr><td>{html.escape(token_text(tokenizer, t.token))}</td><td class=n>{t.probability:.4f}</td>"
                   f"<td><span class=bar style='width:{t.probability * 120:.0f}px'></span></td></tr>" for t in tokens)
    return f"<table><tr><th colspan=3>{html.escape(title)}</th></tr>{rows}</table>"


def step_html(view: StepView, tokenizer: Any, expanded: bool = False) -> str:
    record: StepRecord = view.record
    block = "".join(
        f"<tr><td class=n>{row}</td><td>{html.escape(token_text(tokenizer, token))}</td><td class=n>"
        f"{record.positions[row]}</td><td class=mask>{''.join('■' if s else '·' for s in record.mask[row].tolist())}"
        f"</td></tr>" for row, token in enumerate(record.block_tokens))
    drafts = "".join(
        f"<tr class='{row.decision.split()[0]}'><td class=n>{row.node}</td><td class=n>{row.parent}</td><td>"
        f"{html.escape(row.token_text(tokenizer))}</td><td class=n>{row.q:.4f}</td><td class=n>{row.p:.4f}</td>"
        f"<td class=n>{'-' if row.acceptance is None else f'{row.acceptance:.4f}'}</td>"
        f"<td class=n>{'-' if row.uniform is None else f'{row.uniform:.4f}'}</td><td>{row.decision}</td></tr>"
        for row in view.rows)
    charts = [bars_html(f"q at block row {view.at}", view.q_top, tokenizer)] if view.q_top else []
    charts.append(bars_html(f"p at block row {view.at}", view.p_top, tokenizer))
    if record.rejected and record.parents is None and not record.greedy:
        charts.append(bars_html("norm(max(0, p - q)): drawn from", view.final_top, tokenizer))
    emitted = " ".join(html.escape(token_text(tokenizer, t)) for t in record.emitted)
    kind = "tree" if record.parents is not None else "chain"
    by = f" by {record.drafter}" if record.drafter else ""
    summary = (f"step {record.index}: {record.gamma} drafted ({kind}{by}), {record.num_accepted} accepted"
               f"{', rejection' if record.rejected else ''}"
               f"{f', {len(record.relaxed)} kept by the LOSSY rule only' if record.relaxed else ''}; "
               f"draft {record.draft_ms:.2f} ms, target forward + verify {record.verify_ms:.2f} ms")
    return (f"<details{' open' if expanded else ''}>"
            f"<summary>{html.escape(summary)}</summary>"
            f"<table><tr><th>row</th><th>token</th><th>position</th><th>sees (block rows; and the "
            f"{record.context_length - 1} cached tokens)</th></tr>{block}</table>"
            f"<table><tr><th>node</th><th>parent</th><th>token</th><th>q(x)</th><th>p(x)</th><th>min(1, p/q)</th>"
            f"<th>u</th><th>decision</th></tr>{drafts}</table><div class=charts>{''.join(charts)}</div>"
            f"<p>emitted: {emitted}</p></details>")


def stats_html(stats: SpecStats, costs: RunCosts, baseline: SpecStats | None) -> str:
    rows = [("new tokens", f"{stats.generated_tokens}"), ("target forwards (steps)", f"{stats.target_forwards}"),
            ("drafted / accepted", f"{stats.drafted} / {stats.accepted}"),
            ("alpha (accepted / drafted)", f"{stats.alpha:.3f}"),
            ("alpha (accepted / (accepted + rejections)), for the curve", f"{costs.alpha:.3f}"),
            ("tau (tokens per target forward)", f"{stats.tau:.2f}"),
            ("acceptance by position", " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)),
            ("time: prefill / draft / verify", f"{stats.prefill_seconds:.3f} / {stats.draft_seconds:.3f} / "
                                               f"{stats.verify_seconds:.3f} s"),
            ("tokens per second", f"{stats.tokens_per_second:.1f}")]
    if baseline is not None and costs.c is not None:
        rows += [("target alone: tokens per second", f"{baseline.tokens_per_second:.1f}"),
                 ("measured speedup", f"{costs.measured_speedup:.2f}x"),
                 ("c (median draft ms per token / target-alone ms per forward)", f"{costs.c:.3f}"),
                 ("verify forward / one-token forward (median)", f"{costs.verify_ratio:.2f}")]
    return "<table>" + "".join(f"<tr><td>{html.escape(name)}</td><td class=n>{html.escape(value)}</td></tr>"
                               for name, value in rows) + "</table>"


def report_html(run: RecordedRun, tokenizer: Any, baseline: SpecStats | None, gamma: int, prompt: str,
                lossless: LosslessCheck | None = None, step: int | None = None) -> str:
    """The page; step: the step shown expanded (None: the first with a rejection); lossless: that
    step's re-run (its histogram against p is added)."""
    costs = run_costs(run, baseline)
    figures = plots(run, costs, gamma)
    shown = chosen_step(run.records, step)
    lossless_section = "" if lossless is None else (
        f"<h2>lossless: step {shown.index}'s verification re-run with {lossless.seeds} seeds</h2><p>The first token "
        f"emitted, counted over the seeds, next to p: chi-square p-value {lossless.p_value:.3f}.</p>"
        f"{figure_tag(lossless_figure(lossless, tokenizer), 'lossless re-run')}")
    steps = "".join(step_html(step_view(record), tokenizer, record is shown) for record in run.records)
    sampling = run.sampling
    return (f"<!doctype html><html><head><meta charset=utf-8><title>specdec explain</title><style>{STYLE}</style>"
            f"</head><body><h1>specdec explain</h1><pre><span style='color:#888'>{html.escape(prompt)}</span>"
            f"{html.escape(run.result.text)}</pre><p>temperature {sampling.temperature}, top-k {sampling.top_k}, "
            f"top-p {sampling.top_p}, seed {sampling.seed}, gamma {gamma}: {len(run.records)} steps.</p>"
            f"<h2>the run</h2>{stats_html(run.result.stats, costs, baseline)}<div class=charts>"
            f"{''.join(figures)}</div>{lossless_section}<h2>every step</h2><p>Each step drafts tokens, runs the target "
            f"once over [last token, drafts], keeps draft x when u &lt; min(1, p(x)/q(x)), and at the first "
            f"rejection draws the target's own token from norm(max(0, p - q)).</p>{steps}</body></html>")


def write_report(path: str, run: RecordedRun, tokenizer: Any, baseline: SpecStats | None, gamma: int,
                 prompt: str, lossless: LosslessCheck | None = None, step: int | None = None) -> None:
    Path(path).write_text(report_html(run, tokenizer, baseline, gamma, prompt, lossless, step), encoding="utf-8")
