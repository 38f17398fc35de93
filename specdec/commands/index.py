"""`specdec index build PATH... --target DIR|FILE.gguf --out INDEX`: a datastore of code for the
corpus drafter (specdec.corpus_index), tokenized with the target's tokenizer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from specdec.names import help_formatter
from specdec.progress import waiting


def add_parser(commands: Any) -> None:
    index = commands.add_parser("index", help="datastores of code for the corpus drafter (--index)",
                                formatter_class=help_formatter())
    actions = index.add_subparsers(dest="index_command", required=True)
    build = actions.add_parser(
        "build", formatter_class=help_formatter(),
        help="tokenize the files under PATH... into a datastore that --index INDEX drafts from",
        description="Tokenizes every file under PATH... (.py unless --glob says otherwise; files that quote a "
        "benchmark suite are left out) with the target's tokenizer into a datastore: the tokens and their suffix "
        "array, memory-mapped when a drafter reads it. A datastore is refused for a target of another tokenizer.")
    build.add_argument("paths", nargs="+", metavar="PATH", help="files or folders: a repository, site-packages, ...")
    build.add_argument("--target", required=True, help="the model whose tokenizer it is for: a Hugging Face folder "
                       "or a .gguf file")
    build.add_argument("--out", required=True, metavar="INDEX", help="the datastore's folder (replaced if it exists)")
    build.add_argument("--glob", action="append", default=[], metavar="PATTERN",
                       help="file names to take, such as '*.js' (repeatable; default: *.py)")
    build.add_argument("--trust-remote-code", action="store_true", help="allow tokenizers that ship their own code")


def load_tokenizer(target: str, trust_remote_code: bool) -> Any:
    """The tokenizer of a Hugging Face folder or a GGUF file, without its weights."""
    from transformers import AutoTokenizer

    path = Path(target)
    if not path.exists():
        raise FileNotFoundError(f"target not found: {target}")
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def run(args: argparse.Namespace, console: Console, errors: Console) -> int:
    from specdec.corpus_index import build_index, describe_build

    tokenizer = load_tokenizer(args.target, args.trust_remote_code)
    out = Path(args.out)
    with waiting(errors, f"building the datastore {out}") as update:
        report = build_index(args.paths, tokenizer, out, globs=args.glob, progress=update)
    console.print(describe_build(report, out), highlight=False, soft_wrap=True)
    return 0
