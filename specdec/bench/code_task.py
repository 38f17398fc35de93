"""A HumanEval problem as a bench prompt carries it (runner.Prompt.task), and how an output for it
becomes a program to run: apart from humaneval.py, which reads the suite and scores it, so that the
runner's Prompt can name the type without importing the suite (no import cycle)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# A completion ends where a new top-level statement starts: the function is written by then.
COMPLETION_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(")


@dataclass(frozen=True)
class CodeTask:
    """One HumanEval problem, and how an output for it becomes a program to run."""

    task_id: str
    prompt: str  # the signature and docstring (imports and helper functions before it, on some)
    test: str  # defines check(candidate)
    entry_point: str
    chat: bool = False  # the output is a chat answer holding a code block (else a completion of prompt)

    def solution(self, output: str) -> str:
        """The code that defines the function: the prompt and its completion, or the prompt and the
        answer's code block (whose def, coming second, is the one the tests call)."""
        if not self.chat:
            return self.prompt + truncate_at_stops(output, COMPLETION_STOPS)
        code = extract_code(output)
        if re.search(rf"^def\s+{re.escape(self.entry_point)}\s*\(", code, re.MULTILINE):
            return self.prompt + "\n" + code
        return self.prompt + code  # the body alone, indented under the prompt's signature

    def program(self, output: str) -> str:
        return f"{self.solution(output)}\n\n{self.test}\n\ncheck({self.entry_point})\n"


def truncate_at_stops(text: str, stops: Iterable[str]) -> str:
    """The text before the first stop string (engines that ignore stop strings ran past it)."""
    ends = [index for index in (text.find(stop) for stop in stops) if index >= 0]
    return text[: min(ends)] if ends else text


def extract_code(answer: str) -> str:
    """The first fenced code block of a chat answer (``` with or without a language), up to its
    closing fence or the end (a stop string cut the fence off); the whole answer where it has no
    fence (a model that answered with bare code)."""
    opening = re.search(r"^[ \t]*```[^\n`]*\n", answer, re.MULTILINE)
    if opening is None:
        return answer
    rest = answer[opening.end():]
    closing = re.search(r"^[ \t]*```", rest, re.MULTILINE)
    return rest[: closing.start()] if closing else rest
