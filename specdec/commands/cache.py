"""`specdec cache list` / `specdec cache clear [NAME...]`: the packed models stored on disk
(specdec.models.packed_store), what each holds and takes, and removing them."""

from __future__ import annotations

import argparse
import shutil
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from specdec.names import help_formatter


def add_parser(commands: Any) -> None:
    cache = commands.add_parser("cache", help="packed models stored on disk: list them, clear them",
                                formatter_class=help_formatter())
    actions = cache.add_subparsers(dest="cache_command", required=True)
    actions.add_parser("list", help="each packed model stored: its checkpoint, precision, size and age",
                       formatter_class=help_formatter())
    clear = actions.add_parser("clear", help="remove stored packed models (all, or those whose folder or "
                               "checkpoint path contains NAME); the next load packs them again",
                               formatter_class=help_formatter())
    clear.add_argument("names", nargs="*", metavar="NAME", help="a part of the entry's folder or checkpoint path")


def run(args: argparse.Namespace, console: Console, errors: Console) -> int:
    from specdec.models.packed_store import entries, store_root

    stored = entries()
    if args.cache_command == "list":
        if not stored:
            console.print(f"no packed models stored in {store_root()}", highlight=False)
            return 0
        table = Table(title=f"packed models in {store_root()}")
        for column in ("entry", "checkpoint", "precision", "size", "written"):
            table.add_column(column, justify="right" if column == "size" else "left")
        for entry in stored:
            written = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry.folder.stat().st_mtime))
            table.add_row(entry.folder.name, entry.manifest.get("source", "?"), entry.manifest["quantized"],
                          f"{entry.nbytes / 2**30:.2f} GiB", written)
        console.print(table)
        total = sum(entry.nbytes for entry in stored)
        console.print(f"{len(stored)} entries, {total / 2**30:.2f} GiB", highlight=False)
        return 0
    chosen = [entry for entry in stored if not args.names or any(
        name in entry.folder.name or name in entry.manifest.get("source", "") for name in args.names)]
    for entry in chosen:
        shutil.rmtree(entry.folder, ignore_errors=True)
    console.print(f"removed {len(chosen)} packed models ({sum(entry.nbytes for entry in chosen) / 2**30:.2f} GiB) "
                  f"from {store_root()}", highlight=False)
    return 0
