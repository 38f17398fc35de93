"""Output that reads well in a terminal and in a log: waits without a progress bar (a spinner on
a terminal, a log line otherwise: a pipe, a CI log or a file shows what the command is waiting
for, and each update), and a console whose tables keep every column in a log."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console

LOG_WIDTH = 200  # columns when output is not a terminal: no table column cut, titles centred near the table


def output_console() -> Console:
    """Standard output: a terminal's own width; elsewhere (a pipe, a log file) wide, since rich
    would otherwise cut every table to 80 columns (a table is only as wide as its cells)."""
    console = Console()
    return console if console.is_terminal else Console(width=LOG_WIDTH)


@contextmanager
def waiting(console: Console, message: str) -> Iterator[Callable[[str], None]]:
    """``with waiting(errors, "loading models") as update: ...``; update(text) replaces the message."""
    if console.is_terminal:
        with console.status(message) as status:
            yield lambda text: status.update(text)
        return
    console.print(f"[dim]{message}...[/]", highlight=False, soft_wrap=True)
    yield lambda text: console.print(f"[dim]{text}[/]", highlight=False, soft_wrap=True)


def dim_lines(console: Console) -> Callable[[str], None]:
    """A function that prints a line on ``console``, dim: what a command says as it goes."""
    return lambda text: console.print(f"[dim]{text}[/]", highlight=False, soft_wrap=True)
