"""`specdec generate | ...`: the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from specdec.engine import SpeculativeDecoder, TokenSource
from specdec.metrics import SpecStats

# How --show colours each token: a person sees which tokens the draft got right.
SOURCE_STYLES = {
    TokenSource.DRAFT: "green",
    TokenSource.CORRECTION: "bold red",
    TokenSource.BONUS: "bold blue",
    TokenSource.TARGET: "",
}


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model folder (Hugging Face format)")
    parser.add_argument("--draft", help="draft model folder (same tokenizer as the target)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--quantize", choices=["int8"], help="int8 weights (dynamic int8 linears, CPU only)")
    parser.add_argument("--backend", default="auto", choices=["auto", "specdec", "transformers"],
                        help="own Llama-family forward, transformers adapter, or auto (own where supported)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow checkpoints that ship their own code")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0.0 = off")
    parser.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate text from a prompt, speculatively")
    generate.add_argument("prompt")
    add_model_options(generate)
    add_sampling_options(generate)
    generate.add_argument("--gamma", type=int, default=4, help="draft tokens per step")
    generate.add_argument("--max-new-tokens", type=int, default=128)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--no-draft", action="store_true", help="run the target alone (the baseline)")
    generate.add_argument("--show", action="store_true",
                          help="colour tokens: green = accepted draft, red = target's correction, blue = bonus")
    generate.add_argument("--json", action="store_true", help="print the stats as JSON instead of a table")
    return parser


def stats_table(stats: SpecStats, title: str = "speculative decoding") -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("new tokens", f"{stats.generated_tokens}"),
        ("target forwards", f"{stats.target_forwards}"),
        ("drafted / accepted", f"{stats.drafted} / {stats.accepted}"),
        ("alpha (acceptance rate)", f"{stats.alpha:.3f}"),
        ("tau (tokens per target forward)", f"{stats.tau:.2f}"),
        ("acceptance by position", " ".join(f"{a:.2f}" for a in stats.acceptance_by_position) or "-"),
        ("time: prefill / draft / verify / rest", f"{stats.prefill_seconds:.3f} / {stats.draft_seconds:.3f} / "
                                                 f"{stats.verify_seconds:.3f} / {stats.other_seconds:.3f} s"),
        ("tokens per second", f"{stats.tokens_per_second:.1f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def run_generate(args: argparse.Namespace, console: Console, errors: Console) -> int:
    from specdec.models.loading import load

    if not args.target:
        errors.print("[red]error:[/] --target DIR is required (a Hugging Face-format model folder)")
        return 2
    options = dict(dtype=args.dtype, device=args.device, quantize=args.quantize, backend=args.backend,
                   trust_remote_code=args.trust_remote_code)
    with errors.status("loading models"):
        target = load(args.target, **options)
        draft = None if args.no_draft or not args.draft else load(args.draft, **options)
    if draft is None and not args.no_draft:
        errors.print("[yellow]no --draft given: running the target alone[/]")
    decoder = SpeculativeDecoder(target, draft, gamma=args.gamma)
    result = None
    for chunk in decoder.stream(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                                stop=args.stop):
        if args.show:
            line = Text()
            for piece, source in zip(chunk.token_texts, chunk.sources):
                line.append(piece, style=SOURCE_STYLES[source])
            console.print(line, end="")
        else:
            console.out(chunk.text, end="", highlight=False)
        console.file.flush()
        result = chunk.result or result
    console.print()
    if args.show:
        legend = Text("tokens: ")
        for source, style in SOURCE_STYLES.items():
            if style:
                legend.append(f"{source.value} ", style=style)
        errors.print(legend)
    if args.json:
        import json

        errors.print_json(json.dumps({"finish_reason": result.finish_reason, **result.stats.to_dict()}))
    else:
        title = "target only" if draft is None else f"speculative decoding, gamma={args.gamma}"
        errors.print(stats_table(result.stats, title))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console, errors = Console(), Console(stderr=True)
    try:
        if args.command == "generate":
            return run_generate(args, console, errors)
    except (ValueError, FileNotFoundError) as error:
        errors.print(f"[red]error:[/] {error}")
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
