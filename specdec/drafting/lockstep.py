"""Drafting several requests in lockstep: one draft forward per depth for all of them.

A drafting routine (chain_steps, tree_steps) is written once, as a
generator: it yields what it needs scored next (a block of tokens, a depth of tree nodes),
receives the scores, and returns its Draft. ``run_in_lockstep`` gathers every request's question
of a round and answers them all with one batched call (a head's or a draft model's forward over
the ragged batch); a request alone is a batch of one, so its drafts are made the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import torch

from specdec.core.drafts import Draft

Question = TypeVar("Question")
Answer = TypeVar("Answer")
#: A drafting routine: yields questions, is sent their scores, returns the draft.
DraftSteps = Generator[Question, torch.Tensor, Draft]


def relay(
    steps: DraftSteps[Question],
    ask: Callable[[Question], Answer],
    read: Callable[[torch.Tensor], torch.Tensor],
) -> DraftSteps[Answer]:
    """The routine ``steps`` asking in other words: each question as ``ask`` puts it, each
    answer as ``read`` makes of it (a draft model's routine asks for forwards of its row)."""
    try:
        question = next(steps)
        while True:
            question = steps.send(read((yield ask(question))))
    except StopIteration as done:
        return done.value


def run_in_lockstep(
    steps: Sequence[DraftSteps[Question]],
    answer_all: Callable[[list[int], list[Question]], Sequence[torch.Tensor]],
) -> list[Draft]:
    """Drive several routines round by round: each round, the routines still drafting ask, and
    ``answer_all(indices, questions)`` answers them all at once (index i is steps[i]). A routine
    that is done drops out; the others go on."""
    drafts: list[Any] = [None] * len(steps)
    asking: dict[int, Question] = {}

    def advance(index: int, scores: torch.Tensor | None) -> None:
        try:
            asking[index] = steps[index].send(scores)  # type: ignore[arg-type]  # None starts a routine
        except StopIteration as done:
            drafts[index] = done.value

    for index in range(len(steps)):
        advance(index, None)
    while asking:
        indices, questions = list(asking), list(asking.values())
        asking.clear()
        for index, scores in zip(indices, answer_all(indices, questions), strict=True):
            advance(index, scores)
    return drafts
