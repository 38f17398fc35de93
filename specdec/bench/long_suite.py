"""`specdec bench --suite long`: whole source files as code assistants send them, ~2k to ~16k tokens.

Each prompt is the start of a source file of an installed package (not the Python standard library,
which the default retrieval datastore indexes), cut at a line boundary near the length, then one of
three asks: continue the file into the body of the method whose signature ends the prompt, add a
method where the cut falls, or answer a question about the code in a comment. Categories are the
lengths (``4k``...); ids name the file and the ask. Lengths are approximate: a cut falls at about
CHARS_PER_TOKEN characters a token (code through a BPE tokenizer), and the run reports each
prompt's real token count.
"""

from __future__ import annotations

import importlib
import inspect

from specdec.bench.runner import Prompt
from specdec.suite_sources import LONG_SOURCES as SOURCES

#: Approximate prompt lengths, in tokens, and the category each gives.
LENGTHS = {"2k": 2048, "4k": 4096, "8k": 8192, "16k": 16384}
CHARS_PER_TOKEN = 4.8  # measured on these files with the Qwen2.5 and SmolLM2 tokenizers (4.6-5.3)
TASKS = ("continue", "add-method", "question")


def long_suite() -> list[Prompt]:
    """Every length x file x ask, by length (shortest first), then file, then ask."""
    texts = {name: inspect.getsource(importlib.import_module(name)) for name in SOURCES}
    return [Prompt(category, ask(task, text, int(tokens * CHARS_PER_TOKEN)), f"{name}:{task}")
            for category, tokens in LENGTHS.items() for name, text in texts.items() for task in TASKS]


def ask(task: str, text: str, chars: int) -> str:
    """The file cut near ``chars`` characters, then ``task``'s ask."""
    lines = text.splitlines(keepends=True)
    # The first def at or after the cut: the prompt ends before it (an edge between two methods).
    start, at = 0, 0
    for index, line in enumerate(lines):
        if start >= chars and line.lstrip().startswith("def "):
            at = index
            break
        start += len(line)
    else:
        raise ValueError(f"no def after {chars} characters: the file is too short for this length")
    head, signature = "".join(lines[:at]), lines[at]
    indent = signature[: len(signature) - len(signature.lstrip())]
    if task == "continue":  # the signature (to its colon) ends the prompt: the model writes the body
        end = at
        while not lines[end].rstrip().endswith(":"):
            end += 1
        return head + "".join(lines[at : end + 1])
    if task == "add-method":
        return (head + f"{indent}# A new method: a short summary of this object's state as a string, for logs.\n"
                + f"{indent}def ")
    if task == "question":
        return head.rstrip() + "\n\n# Question: in two sentences, what does the code above do?\n# Answer:"
    raise ValueError(f"unknown ask {task!r}; choose one of {', '.join(TASKS)}")
