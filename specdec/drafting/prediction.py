"""Predicted outputs (OpenAI's ``prediction``): the client sends the text it expects the answer to
be (an editor applying an edit: the file as it is now), and this drafter copies it.

Its state follows where the output is in the prediction: a pointer to the predicted token the
next output token should be. Each step drafts the tokens from the pointer on; each emitted token
that equals the predicted one moves the pointer past it. Where the output leaves the prediction
(a renamed identifier, an inserted line, a deleted one), the pointer is lost until the output's
recent tokens occur in the prediction again: the longest recent run found there (at least
``min_match`` tokens) sets the pointer after it, the occurrence nearest ahead of the old pointer
first (an insertion or a replacement resumes after it; a deletion skips ahead), else the nearest
behind it (a repeated line). Its drafts are point masses, verified like any guess: the output is
the target's whatever the prediction says (greedy identity, the sampled law, the coupled rule).

How long: right after a mismatch a short draft (``restart``), doubling with each step whose draft
was all accepted, up to gamma; under ``auto`` (the default), its cost model then chooses the
length from this drafter's measured acceptance by position and T(k)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome

PREDICTION = "prediction"  # the drafter's name (auto's candidate; the stats' and the API's counts)


@dataclass
class PredictionState:
    """One request's place in its prediction (read from its sampling at its first step: start()
    sees only the prompt)."""

    predicted: list[int] = field(default_factory=list)  # the prediction's token ids
    read: bool = False  # whether they were read from the request yet
    # each min_match-gram of the prediction -> where its occurrences end, ascending
    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    pointer: int | None = 0  # the predicted token the next output token should equal (None: lost)
    anchor: int = 0  # where the pointer was when the output last left the prediction
    length: int = 0  # how long the next draft may be (grows while right, short after a miss)
    seen: list[int] = field(default_factory=list)  # the output so far (the emitted tokens)


class PredictionDrafter(BaseDrafter):
    """Drafts the prediction from where the output is in it (module docstring). A request with
    no prediction gets no draft."""

    # A copy of text the client sent, not of this request's output: auto judges it on every step
    # and lets it set no reach class (as a datastore's retrieval).
    retrieves = True

    def __init__(self, min_match: int = 3, restart: int = 2) -> None:
        if min_match < 1 or restart < 1:
            raise ValueError(f"min_match and restart must be >= 1, got {min_match} and {restart}")
        self.min_match, self.restart = min_match, restart

    def describe(self) -> str:
        return "prediction (the client's predicted output, followed through its edits)"

    def start(self, prompt_ids: torch.Tensor) -> PredictionState:
        return PredictionState(length=self.restart)

    def state(self, request: DraftRequest) -> PredictionState | None:
        """The request's state, its prediction indexed at the first call; None without one."""
        predicted = request.sampling.prediction
        if not predicted or isinstance(predicted, str):  # (text is encoded by the text layer first)
            return None
        state: PredictionState = request.draft_state
        if not state.read:
            state.predicted, state.read = list(predicted), True
            for end in range(self.min_match, len(state.predicted) + 1):
                state.index.setdefault(tuple(state.predicted[end - self.min_match : end]), []).append(end)
        return state

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        device = request.context.device
        state = self.state(request)
        if state is None or state.pointer is None or gamma <= 0:
            return Draft.empty(device)
        tokens = state.predicted[state.pointer : state.pointer + min(gamma, max(state.length, 1))]
        return Draft(torch.tensor(tokens, dtype=torch.long, device=device), None, None, drafter=PREDICTION)

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        state = self.state(request)
        if state is None:
            return
        emitted = outcome.emitted.tolist()
        all_right = outcome.num_drafted > 0 and outcome.num_accepted == outcome.num_drafted
        for token in emitted:
            state.seen.append(token)
            if state.pointer is not None and state.pointer < len(state.predicted) \
                    and state.predicted[state.pointer] == token:
                state.pointer += 1
            else:
                state.anchor = state.anchor if state.pointer is None else state.pointer
                state.pointer = self.rejoin(state)
                all_right = False
        state.length = min(2 * state.length, 1 << 16) if all_right else self.restart

    def rejoin(self, state: PredictionState) -> int | None:
        """Where the output joins the prediction again (module docstring); None: nowhere yet."""
        if len(state.seen) < self.min_match:
            return None
        ends = state.index.get(tuple(state.seen[-self.min_match :]), [])
        if not ends:
            return None
        # the longest recent run that ends there: the occurrences that agree furthest back win
        agree = {end: self.agreement(state, end) for end in ends}
        longest = max(agree.values())
        candidates = [end for end in ends if agree[end] == longest]
        ahead = bisect.bisect_left(candidates, state.anchor)
        return candidates[ahead] if ahead < len(candidates) else candidates[-1]

    @staticmethod
    def agreement(state: PredictionState, end: int, most: int = 64) -> int:
        """How many of the output's last tokens equal the prediction's before ``end`` (at most ``most``)."""
        count = 0
        while count < min(most, end, len(state.seen)) and \
                state.predicted[end - 1 - count] == state.seen[len(state.seen) - 1 - count]:
            count += 1
        return count
