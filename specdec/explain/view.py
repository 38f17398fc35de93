"""The terminal view of a step (rich): drafts with q and p, draws, decisions, bar charts."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from specdec.explain.lossless import LosslessCheck
from specdec.explain.steps import StepView, TopToken, token_text

BAR_WIDTH = 24
DECISION_STYLES = {"accepted": "green", "on the path": "green", "rejected": "bold red", "not reached": "dim",
                   "off the path": "dim", "accepted (relaxed)": "bold dark_orange",
                   "on the path (relaxed)": "bold dark_orange"}


def bar(probability: float, width: int = BAR_WIDTH) -> str:
    filled = probability * width
    return "█" * int(filled) + ("▌" if filled - int(filled) >= 0.5 else "")


def bar_chart(title: str, tokens: list[TopToken], tokenizer: Any, mark: int | None = None) -> Table:
    chart = Table(title=title, show_header=False, box=None, padding=(0, 1))
    chart.add_column("token", max_width=14, no_wrap=True)
    chart.add_column("probability", justify="right")
    chart.add_column("bar", style="cyan")
    for top in tokens:
        style = "bold yellow" if top.token == mark else None
        chart.add_row(token_text(tokenizer, top.token), f"{top.probability:.3f}", bar(top.probability), style=style)
    return chart


def block_table(view: StepView, tokenizer: Any) -> Table:
    """The target's one forward: block tokens, positions, and the attention mask among them."""
    record = view.record
    kind = "chain: causal" if record.parents is None else "tree: each node sees its ancestors"
    table = Table(title=Text(f"the target's single forward over [last token, drafts] ({kind}; every row also "
                             f"sees the {record.context_length - 1} cached context tokens)"))
    table.add_column("row", justify="right")
    table.add_column("token")
    table.add_column("position", justify="right")
    table.add_column("sees (block rows)")
    table.add_column("its logits give")
    for row, token in enumerate(record.block_tokens):
        sees = "".join("■" if seen else "·" for seen in record.mask[row].tolist())
        role = "p after the context" if row == 0 else f"p after draft node {row - 1}"
        table.add_row(str(row), token_text(tokenizer, token), str(record.positions[row]), sees, role)
    return table


def drafts_table(view: StepView, tokenizer: Any) -> Table:
    table = Table(title="each drafted token: accept when u < min(1, p(x) / q(x))")
    for name in ("node", "parent", "token", "q(x)", "p(x)", "min(1, p/q)", "u", "decision"):
        table.add_column(name, justify="right" if name not in ("token", "decision") else "left")
    for row in view.rows:
        table.add_row(str(row.node), str(row.parent), Text(row.token_text(tokenizer)), f"{row.q:.4f}", f"{row.p:.4f}",
                      "-" if row.acceptance is None else f"{row.acceptance:.4f}",
                      "-" if row.uniform is None else f"{row.uniform:.4f}",
                      Text(row.decision, style=DECISION_STYLES[row.decision]))
    return table


def outcome_text(view: StepView, tokenizer: Any) -> Text:
    record = view.record
    emitted = " ".join(token_text(tokenizer, t) for t in record.emitted)
    if record.rejected:
        how = "rejected: the target's token is drawn from the residual norm(max(0, p - q))"
    elif record.gamma:
        how = "every draft accepted: the bonus token is drawn from p after the last draft"
    else:
        how = "nothing drafted: plain decoding"
    if record.greedy:
        how = "greedy: drafts are kept while they equal the target's argmax, then the argmax is emitted"
    if record.relaxed:
        how += (f"; LOSSY: {len(record.relaxed)} draft(s) marked (relaxed) were rejected by the exact test and "
                "kept by the --acceptance rule")
    return Text(f"emitted {record.num_accepted + 1} token(s) ({emitted}); {how}")


def charts(view: StepView, tokenizer: Any) -> Table:
    emitted = view.record.emitted[-1]
    drafted = view.record.draft_tokens[view.at] if view.at < view.record.gamma and view.record.parents is None else None
    grid = Table.grid(padding=(0, 3))
    parts = []
    if view.q_top:
        parts.append(bar_chart(f"q at block row {view.at} (draft)", view.q_top, tokenizer, drafted))
    parts.append(bar_chart(f"p at block row {view.at} (target)", view.p_top, tokenizer, drafted))
    if view.record.rejected and view.record.parents is None and not view.record.greedy:
        parts.append(bar_chart("norm(max(0, p - q)): drawn from", view.final_top, tokenizer, emitted))
    for _ in parts:
        grid.add_column()
    grid.add_row(*parts)
    return grid


def cost_text(view: StepView) -> Text:
    record = view.record
    return Text(f"cost: drafting {record.draft_ms:.2f} ms for {record.gamma} token(s); the target's one forward over "
                f"{record.gamma + 1} tokens plus verification {record.verify_ms:.2f} ms")


def step_renderable(view: StepView, tokenizer: Any, steps: int) -> RenderableType:
    record = view.record
    title = Text(f"step {record.index} of {steps}: context of {record.context_length} tokens, "
                 f"{record.gamma} drafted{' (a tree)' if record.parents is not None else ''}"
                 f"{f', by {record.drafter} (auto)' if record.drafter else ''}", style="bold")
    return Group(title, block_table(view, tokenizer), drafts_table(view, tokenizer), charts(view, tokenizer),
                 outcome_text(view, tokenizer), cost_text(view))


def lossless_renderable(check: LosslessCheck, tokenizer: Any, top: int = 8) -> RenderableType:
    table = Table(title=f"lossless: the step's verification re-run with {check.seeds} seeds (drafts redrawn from q): "
                        "first emitted token vs p")
    for name in ("token", "emitted share", "", "p", ""):
        table.add_column(name, justify="right" if name in ("emitted share", "p") else "left")
    shares = check.counts.double() / check.seeds
    for token in check.p.topk(min(top, check.p.shape[0])).indices.tolist():
        table.add_row(token_text(tokenizer, token), f"{float(shares[token]):.4f}", bar(float(shares[token])),
                      f"{float(check.p[token]):.4f}", bar(float(check.p[token])))
    verdict = "consistent with p" if check.p_value > 0.001 else "NOT consistent with p"
    return Group(table, Text(f"chi-square over {len(check.bins) + 1} bins: statistic {check.statistic:.2f}, "
                             f"p-value {check.p_value:.3f}: {verdict}"))
