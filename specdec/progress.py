"""Waits that have no progress bar: a spinner on a terminal, a log line otherwise (a pipe, a CI
log or a file shows what the command is waiting for, and each update)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console


@contextmanager
def waiting(console: Console, message: str) -> Iterator[Callable[[str], None]]:
    """``with waiting(errors, "loading models") as update: ...``; update(text) replaces the message."""
    if console.is_terminal:
        with console.status(message) as status:
            yield lambda text: status.update(text)
        return
    console.print(f"[dim]{message}...[/]", highlight=False, soft_wrap=True)
    yield lambda text: console.print(f"[dim]{text}[/]", highlight=False, soft_wrap=True)
