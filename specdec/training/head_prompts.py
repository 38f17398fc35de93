"""Prompts a draft head's training continuations start from: the kinds of requests users send,
cut from the training files.

A head learns the text the target writes after them, so the prompts should look like what the
head will draft for: the bundled suite's completions (a function's start, a body cut midway),
its docstrings (a signature and an opened docstring), class bodies, and chat requests for a
function from its signature and docstring, as HumanEval reaches an instruct model. Editing
requests (an original and an instruction) are not made here: a file gives no instruction.
"""

from __future__ import annotations

import random
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdec.corpus_files import read_text

KINDS = ("signature", "docstring", "body", "class", "chat")
# What DataPlan keys continuations by: other kinds (or another mix) give other prompts under the
# same numbers.
PROMPT_RULE = "kinds " + " ".join(KINDS) + ", in turn, two a file; chat blocks dedented"
CONTEXT_LINES = 8  # lines before the cut: what the file says before the function
CHAT_BLOCK_LINES = 16  # a chat request's code block at most (a signature and its docstring)
# Chat requests in several wordings (none of them a benchmark suite's).
CHAT_REQUESTS = (
    "Implement this Python function.",
    "Write the body of the following function.",
    "Please complete this function so that it does what its docstring says.",
    "Fill in the implementation:",
)


@dataclass(frozen=True)
class HeadPrompt:
    kind: str  # one of KINDS
    file: Path
    line: int  # the line of the cut (1-based)
    text: str = ""  # a completion prompt (every kind but chat)
    request: str = ""  # chat: the user's message, sent through the target's chat template


def docstring_end(lines: Sequence[str], start: int) -> int | None:
    """The line that closes the docstring opening at ``start`` (None: no docstring there)."""
    opening = lines[start].strip()[:3] if start < len(lines) else ""
    if opening not in ('"""', "'''"):
        return None
    if lines[start].strip().count(opening) >= 2 and len(lines[start].strip()) > 3:
        return start  # one line
    for number in range(start + 1, min(len(lines), start + CHAT_BLOCK_LINES)):
        if opening in lines[number]:
            return number
    return None


def prompts_of_file(path: Path, generator: random.Random) -> dict[str, list[HeadPrompt]]:
    """Every prompt of each kind this file gives."""
    lines = read_text(path).splitlines()
    found: dict[str, list[HeadPrompt]] = {kind: [] for kind in KINDS}
    for number, line in enumerate(lines):
        stripped = line.strip()
        if number < 2 or not stripped.endswith(":"):
            continue
        before = "\n".join(lines[max(0, number - CONTEXT_LINES) : number + 1]) + "\n"
        where = (path, number + 1)
        if stripped.startswith("class "):
            found["class"].append(HeadPrompt("class", *where, before))
        if not stripped.startswith(("def ", "async def ")):
            continue
        found["signature"].append(HeadPrompt("signature", *where, before))
        closing = docstring_end(lines, number + 1)
        if closing is not None:
            opened = lines[number + 1][: len(lines[number + 1]) - len(lines[number + 1].lstrip())] + '"""'
            found["docstring"].append(HeadPrompt("docstring", *where, before + opened))
            block = textwrap.dedent("\n".join(lines[number : closing + 1]))  # a method's, as a function's
            wording = CHAT_REQUESTS[generator.randrange(len(CHAT_REQUESTS))]
            found["chat"].append(HeadPrompt("chat", *where, request=f"{wording}\n\n```python\n{block}\n```"))
        body_start = number + 1 if closing is None else closing + 1
        body = lines[body_start : body_start + generator.randint(2, 4)]
        if len(body) >= 2 and all(text.strip() for text in body):
            found["body"].append(HeadPrompt("body", *where, before + "\n".join(body) + "\n"))
    return found


def head_prompts(files: Sequence[Path], count: int, seed: int = 0) -> list[HeadPrompt]:
    """Up to ``count`` prompts, the kinds in turn (each kind's prompts shuffled), at most two a
    file. A stream: the first N are the same for any larger count."""
    generator = random.Random(seed)
    by_kind: dict[str, list[HeadPrompt]] = {kind: [] for kind in KINDS}
    for path in files:
        for kind, prompts in prompts_of_file(path, generator).items():
            by_kind[kind].extend(prompts)
    for prompts in by_kind.values():
        generator.shuffle(prompts)
    chosen: list[HeadPrompt] = []
    per_file: dict[Path, int] = {}  # prompts chosen from each file
    positions = dict.fromkeys(KINDS, 0)
    while len(chosen) < count and any(positions[kind] < len(by_kind[kind]) for kind in KINDS):
        for kind in KINDS:
            prompts = by_kind[kind]
            while positions[kind] < len(prompts):  # this kind's next prompt from a file with room
                prompt = prompts[positions[kind]]
                positions[kind] += 1
                if per_file.get(prompt.file, 0) < 2:
                    per_file[prompt.file] = per_file.get(prompt.file, 0) + 1
                    chosen.append(prompt)
                    break
            if len(chosen) == count:
                break
    return chosen
