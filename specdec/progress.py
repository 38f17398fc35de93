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


@contextmanager
def library_bars_off_unless_terminal() -> Iterator[None]:
    """transformers' and huggingface_hub's progress bars (loading, converting, writing weights)
    off while the block runs, where stderr is not a terminal: a log or a pipe would get their
    carriage-return frames, one line of them per bar; our own status lines say what runs."""
    import sys

    if sys.stderr.isatty():
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    hub_was_off, transformers_was_on = are_progress_bars_disabled(), transformers_logging.is_progress_bar_enabled()
    disable_progress_bars()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not hub_was_off:
            enable_progress_bars()
        if transformers_was_on:
            transformers_logging.enable_progress_bar()
