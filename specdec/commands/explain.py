"""`specdec explain`: the argument parser and what each mode runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.text import Text

AddOptions = Callable[[argparse.ArgumentParser], None]  # cli.py's shared option groups


def add_parser(commands: Any, add_model_options: AddOptions, add_sampling_options: AddOptions,
               add_drafting_options: AddOptions) -> None:  # commands: the CLI's subparsers
    explain = commands.add_parser(
        "explain", help="see speculation happen: one generation's steps with q, p, draws and decisions",
        description="Runs one generation and shows a step (default: the first with a rejection): the drafted "
                    "tokens with q and p, min(1, p/q), the uniform draw, the decision, the residual max(0, p - q) "
                    "on rejection, the verify block's positions and attention mask, and the step's cost. "
                    "--calculator instead tabulates Leviathan et al.'s expected speedup for each gamma.")
    explain.add_argument("prompt", nargs="?", help="the prompt (not needed with --calculator)")
    add_model_options(explain)
    add_sampling_options(explain)
    add_drafting_options(explain)
    # Sampling shows the draws and a seed makes the run repeatable; a draft model's q is what
    # there is to see, so the draft model and a fixed gamma by default (also for the default pair).
    explain.set_defaults(temperature=0.8, seed=0, drafter="model", no_draft=False)
    explain.add_argument("--max-new-tokens", type=int, default=48)
    explain.add_argument("--step", type=int, help="the step to show (1-based; default: the first with a rejection)")
    explain.add_argument("--seeds", type=int, default=5000,
                         help="re-run the shown step's verification this many times: emitted tokens vs p")
    explain.add_argument("--html", help="write a self-contained HTML report of every step to this file")
    explain.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                         help="also time the target alone (for the measured speedup and c)")
    calculator = explain.add_argument_group("--calculator", "expected tokens per step and speedup for each gamma")
    calculator.add_argument("--calculator", action="store_true", help="tabulate instead of generating")
    calculator.add_argument("--alpha", type=float, help="probability that a draft token is accepted")
    calculator.add_argument("--c", type=float, help="a draft forward's time over a target forward's")
    calculator.add_argument("--verify-cost", type=float, nargs="+",
                            help="T(gamma+1)/T(1), a verify block's time over a one-token forward: one value "
                                 "for every gamma or one per gamma 1..--max-gamma (default 1, Leviathan's "
                                 "assumption)")
    calculator.add_argument("--max-gamma", type=int, default=10)


def run_calculator(args: argparse.Namespace, console: Console) -> int:
    from specdec.explain.calculator import best_row, calculator_table, speedup_table

    if args.alpha is None or args.c is None:
        raise ValueError("--calculator needs --alpha A and --c C")
    rows = speedup_table(args.alpha, args.c, args.max_gamma, args.verify_cost)
    console.print(calculator_table(args.alpha, args.c, rows))
    best = best_row(rows)
    console.print(f"best gamma: {best.gamma} ({best.expected_tokens:.3f} tokens per step, "
                  f"{best.speedup:.3f}x expected speedup)")
    return 0


def run(args: argparse.Namespace, console: Console, errors: Console) -> int:
    if args.calculator:
        return run_calculator(args, console)
    if not args.prompt:
        raise ValueError("no prompt: specdec explain \"PROMPT\" (or --calculator --alpha A --c C)")
    if args.seeds < 100:
        raise ValueError(f"--seeds must be at least 100 for a histogram, got {args.seeds}")
    from specdec.commands.models import load_drafting
    from specdec.commands.options import sampling_from_args
    from specdec.commands.views import stats_table
    from specdec.decoder import GenerationResult, SpeculativeDecoder
    from specdec.explain.lossless import check_lossless
    from specdec.explain.record import chosen_step, record_run
    from specdec.explain.steps import step_view
    from specdec.explain.view import lossless_renderable, step_renderable
    from specdec.progress import waiting

    drafting = load_drafting(args, errors)
    target = drafting.target
    if not drafting.config.drafts:
        raise ValueError("explain needs a drafter: pass --draft (with --target) or --drafter ngram")
    sampling = sampling_from_args(args, max_new_tokens=args.max_new_tokens)
    with waiting(errors, "generating, every step recorded"):
        run = record_run(lambda hook: drafting.engine(verify_hook=hook), args.prompt, sampling, warm_up=True)
    alone: GenerationResult | None = None
    if args.compare:
        with waiting(errors, "running the target alone on the same prompt, for the measured speedup"):
            result = SpeculativeDecoder(target).generate(args.prompt, sampling)
        assert isinstance(result, GenerationResult)  # one prompt, one result
        alone = result
    baseline = None if alone is None else alone.stats
    tokenizer = target.tokenizer
    console.print(Text(args.prompt, style="dim") + Text(run.result.text))
    view = step_view(chosen_step(run.records, args.step))
    console.print(step_renderable(view, tokenizer, len(run.records)))
    check = None
    if sampling.lossy:
        relaxed = sum(len(record.relaxed) for record in run.records)
        console.print(Text(f"LOSSY acceptance {sampling.acceptance}: {relaxed} draft(s) over the run were rejected "
                           "by the exact test and kept (marked relaxed); the output's law is not p: no lossless re-run",
                           style="bold dark_orange"))
    elif not sampling.greedy:
        with waiting(errors, f"re-running step {view.record.index}'s verification with {args.seeds} seeds"):
            check = check_lossless(view.record, args.seeds)
        console.print(lossless_renderable(check, tokenizer))
    console.print(stats_table(run.result.stats, f"the whole run ({len(run.records)} steps)", run.result.finish_reason,
                              baseline, alone is not None and alone.text == run.result.text, not sampling.greedy))
    if args.html:
        from specdec.explain.report import write_report

        write_report(args.html, run, tokenizer, baseline, args.speculation_config.chosen_gamma, args.prompt, check,
                     view.record.index)
        errors.print(f"wrote {args.html}")
    return 0
