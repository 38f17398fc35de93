"""Regenerates docs/how-it-works.md and its figures from `specdec explain` runs on the bundled
toy pair: every number in the page is computed here, none is pasted.

    python scripts/how_it_works.py   # about half a minute; it times things: run it on an idle machine
"""

from __future__ import annotations

import datetime
import io
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec.core.sampling import SamplingParams  # noqa: E402
from specdec.decoder import SpeculativeDecoder  # noqa: E402
from specdec.defaults import default_model  # noqa: E402
from specdec.explain.calculator import best_row, calculator_table, speedup_table  # noqa: E402
from specdec.explain.lossless import check_lossless  # noqa: E402
from specdec.explain.record import chosen_step, record_generation  # noqa: E402
from specdec.explain.report import lossless_figure, run_costs, run_figures, write_report  # noqa: E402
from specdec.explain.steps import step_view  # noqa: E402
from specdec.explain.view import lossless_renderable, step_renderable  # noqa: E402
from specdec.models.loading import load  # noqa: E402

PROMPT = "def fibonacci(n):"
GAMMA = 4
SEEDS = 20000
DOCS = ROOT / "docs"
FIGURES = DOCS / "how-it-works"


def rendered(renderable) -> str:
    console = Console(record=True, width=110, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def save(figure, name: str) -> str:
    import matplotlib.pyplot as plt

    path = FIGURES / f"{name.replace(' ', '-')}.png"
    figure.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(figure)
    return f"![{name}](how-it-works/{path.name})"


def screenshot(page: Path, png: Path) -> str:
    """The report as a real browser shows it (headless Chromium, Debian's `chromium` package), as a
    markdown image; without Chromium, a line saying so (the old screenshot is removed, not kept stale)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    png.unlink(missing_ok=True)
    if browser is None:
        return "(No screenshot: Chromium is not installed here; `apt-get install chromium` and rerun.)"
    version = subprocess.run([browser, "--version"], capture_output=True, text=True).stdout.strip()
    subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1280,3000", f"--screenshot={png}", page.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    return f"The report in {version}, headless, 1280 pixels wide:\n\n![the HTML report](how-it-works/{png.name})"


def single_pass_gap(target, context: list[int], block: list[int], sampling: SamplingParams) -> float:
    """Largest |p| difference between the verify block's one forward and feeding the same
    tokens one at a time (what the target would do without a draft)."""
    from specdec.core.sampling import logits_to_probs

    cache = target.new_cache()
    target.extend(torch.tensor(context[:-1]), cache)
    together = target.extend(torch.tensor(block), cache)  # [gamma + 1, vocab]
    cache = target.new_cache()
    target.extend(torch.tensor(context[:-1]), cache)
    alone = torch.cat([target.extend(torch.tensor([token]), cache) for token in block])
    return float((logits_to_probs(together, sampling) - logits_to_probs(alone, sampling)).abs().max())


def main() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    target, draft = load(str(default_model("target"))), load(str(default_model("draft")))
    tokenizer = target.tokenizer
    sampled = SamplingParams(temperature=0.8, seed=0, max_new_tokens=64)
    run = record_generation(target, draft, PROMPT, sampled, GAMMA, warm_up=True)
    baseline_result = SpeculativeDecoder(target).generate(PROMPT, sampled)
    baseline = baseline_result.stats
    costs = run_costs(run, baseline)
    view = step_view(chosen_step(run.records, None))
    record = view.record
    check = check_lossless(record, SEEDS)
    write_report(str(FIGURES / "report.html"), run, tokenizer, baseline, GAMMA, PROMPT, check, record.index)
    report_screenshot = screenshot(FIGURES / "report.html", FIGURES / "report-screenshot.png")
    figures = {name: save(figure, name) for name, figure in run_figures(run, costs, GAMMA).items()}
    figures["lossless"] = save(lossless_figure(check, tokenizer), "lossless")

    greedy = SamplingParams(max_new_tokens=64)
    greedy_run = record_generation(target, draft, PROMPT, greedy, GAMMA)
    greedy_alone = SpeculativeDecoder(target).generate(PROMPT, greedy)
    context = (run.result.prompt_ids + run.result.token_ids)[: record.context_length]
    gap = single_pass_gap(target, context, record.block_tokens, sampled)

    q0, p0 = record.draft_probs()[view.at].double(), record.p[view.at].double()
    overlap = float(torch.minimum(p0, q0).sum())
    residual = (p0 - q0).clamp_min(0) / (p0 - q0).clamp_min(0).sum()
    rebuilt_error = float((torch.minimum(p0, q0) + (1 - overlap) * residual - p0).abs().max())
    stats = run.result.stats
    processed = sum(r.gamma + 1 for r in run.records)
    wasted = sum(r.gamma - r.num_accepted for r in run.records)
    rows = speedup_table(costs.alpha, costs.c, 10, [costs.verify_ratio])
    best = best_row(rows)
    grid_cs = (0.02, 0.05, 0.1, 0.2, 0.3)
    typical = [best_row(speedup_table(alpha, c, 16)).gamma for alpha in (0.6, 0.7, 0.8) for c in (0.1, 0.2, 0.3)]
    grid = "\n".join(
        f"| {alpha} | " + " | ".join(str(best_row(speedup_table(alpha, c, 16)).gamma) for c in grid_cs) + " |"
        for alpha in (0.5, 0.6, 0.7, 0.8, 0.9)
    )
    machine = f"{platform.machine()}, {torch.get_num_threads()} torch threads, {datetime.date.today()}"

    page = f"""# How speculative decoding works, seen on a real run

Generated by `python scripts/how_it_works.py` ({machine}) from `specdec explain` on the bundled toy
pair (a 5.5M-parameter Python-code target, a 0.7M draft), prompt `{PROMPT}`, temperature 0.8,
seed 0, gamma {GAMMA}, 64 new tokens. Every number below comes from that run; rerun the script to
refresh them. The same views for your own models: `specdec explain "prompt" [--target --draft]
[--html report.html]`; the HTML report of this run is [how-it-works/report.html](how-it-works/report.html).

{report_screenshot}

Notation: p = the target's distribution, q = the draft's, both after the same temperature / top-k /
top-p (`specdec/core/sampling.py`); gamma = tokens drafted per step; alpha = the chance a draft token is
accepted; tau = tokens emitted per target forward.

## The step `specdec explain` shows (the first with a rejection)

```
{rendered(step_renderable(view, tokenizer, len(run.records)))}```

## "How does the LLM know the previous probability distributions in a single pass?"

A transformer's forward over n tokens returns logits at *every* position, each computed from the
tokens up to it (the causal mask above: row i sees rows 0..i and the cached context). So one
target forward over [last token, d_1 .. d_{record.gamma}] at positions {record.positions[0]}..{record.positions[-1]} gives
p after the context, after d_1, ..., after d_{record.gamma}: the distributions the target would have
produced one token at a time. Measured on this step: the largest difference between p from the one
block forward and p from feeding the same {record.gamma + 1} tokens one at a time is **{gap:.2e}**
(specdec's verify blocks are batch-invariant: bit-identical).

## "If the draft's q = 0.35 and the target's p = 0.4, do we still decode the same tokens?"

A draft token x is kept with probability min(1, p(x)/q(x)): with p = 0.4 >= q = 0.35 it is always
kept (min(1, 1.14) = 1); had it been q = 0.4, p = 0.35, it would be kept 87.5% of the time. In the
step above, draft token 0 had q = {view.rows[0].q:.4f}, p = {view.rows[0].p:.4f}, so acceptance
{view.rows[0].acceptance:.4f}. The tokens are not always the *same* as the target alone would sample
(different random draws), but they have the *same distribution*. Re-running this step's verification
{SEEDS} times (drafts redrawn from q each time), the first emitted token follows p:

```
{rendered(lossless_renderable(check, tokenizer))}```

{figures["lossless"]}

## "Wouldn't we lose the larger model's intelligence?"

No: every emitted token is the target's, by construction. Greedy (temperature 0): the speculative
output is token-identical to the target alone: {len(greedy_run.result.token_ids)} tokens, identical =
**{greedy_run.result.token_ids == greedy_alone.token_ids}** (with {greedy_run.result.stats.accepted} of {greedy_run.result.stats.drafted} drafted tokens accepted).
Sampling: the same distribution (the chi-square above, p-value {check.p_value:.2f}; the project's law
tests check this for every drafter). The draft only decides how many target tokens one forward yields.

## "We sample from max(0, p - q) because...?"

Split p into the part the draft already covers and the rest: p(x) = min(p(x), q(x)) + max(0, p(x) - q(x)).
Drafting x from q and keeping it with probability min(1, p(x)/q(x)) emits x with probability exactly
min(p(x), q(x)). A rejection happens with probability 1 - sum min(p, q), and what is missing from p is
exactly max(0, p - q), whose total is that same 1 - sum min(p, q). So drawing the replacement from
norm(max(0, p - q)) fills in the missing mass and the sum is p. At block row {view.at} of the step
above: sum min(p, q) = {overlap:.4f} (the chance of acceptance there), and
min(p, q) + (1 - {overlap:.4f}) * norm(max(0, p - q)) rebuilds p to within **{rebuilt_error:.1e}**.

## "Is it more compute?"

Yes, arithmetically: this run's target processed {processed} tokens in {stats.target_forwards} forwards to emit
{stats.generated_tokens} ({processed / stats.generated_tokens:.2f} target tokens per emitted token; plain decoding: 1),
{wasted} drafted tokens were thrown away, and the draft ran on top. It is still faster because
a forward over a few tokens costs about as much as over one (decoding is limited by reading the
weights, not by arithmetic): here a verify forward over {GAMMA + 1} tokens took **{costs.verify_ratio:.2f}x** a one-token
forward (medians). Measured: {stats.tokens_per_second:.1f} tokens/s speculative vs {baseline.tokens_per_second:.1f} target alone,
**{costs.measured_speedup:.2f}x** on this prompt (one run; `specdec bench` measures properly).

{figures["acceptance per position"]} {figures["tau over the run"]}

## "Why K about 3?"

Leviathan et al.: with acceptance alpha per token, a step emits E = (1 - alpha^(gamma+1)) / (1 - alpha)
tokens and costs gamma * c + T(gamma+1)/T(1) target forwards (c: a draft forward over a target forward),
so more drafting pays only while the (1 - alpha) chance of a rejection, which grows with every
position, leaves enough expected tokens. This run measured alpha = {costs.alpha:.2f} (accepted / (accepted +
rejections)), c = {costs.c:.3f}, verify ratio {costs.verify_ratio:.2f}: `specdec explain --calculator --alpha {costs.alpha:.2f}
--c {costs.c:.3f} --verify-cost {costs.verify_ratio:.2f}` gives

```
{rendered(calculator_table(costs.alpha, costs.c, rows))}```

Best gamma {best.gamma} ({best.speedup:.2f}x expected). The best gamma by alpha (rows) and c (columns),
verify ratio 1, gamma searched up to 16 (`speedup_table`, the calculator's numbers):

| alpha \\ c | {" | ".join(str(c) for c in grid_cs)} |
|---|{"---|" * len(grid_cs)}
{grid}

Each extra draft token costs c for sure but pays only if every token before it was accepted
(probability alpha^k): the less accurate or the more expensive the draft, the shorter the best
draft. Drafts that cost a tenth to a third of the target and are accepted 60-80% of the time land on
gamma {min(typical)} to {max(typical)}, which is where "K about 3" comes from; a verify forward that grows with the block
(ratio above 1, measured here) shortens it further. `specdec generate --policy cost` picks gamma this way
from measured numbers while it decodes.

{figures["expected speedup vs gamma"]}
"""
    (DOCS / "how-it-works.md").write_text(page, encoding="utf-8")
    print(f"wrote {DOCS / 'how-it-works.md'} and {FIGURES}/")


if __name__ == "__main__":
    main()
