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

Edits it has seen it makes ahead: where the output left the prediction and joined it again within
a few tokens (a renamed identifier, an added argument), the change is learned as ngram-edit
learns it (specdec.drafting.edits: ``learn_edit``, made in later copies by ``apply_edits``), and
its drafts carry it through every later occurrence instead of failing there. Why: on a rename
of a name used 28 times, each occurrence cost a rejection and the steps to find the prediction
again, and other copies (suffix) drafted there, matching earlier renamed lines whose continuation
differs.

How long: twice as far as the output has followed the prediction since it last left it, at least
``restart`` (a short draft right after a mismatch, long ones where the prediction has held), up to
gamma; under ``auto`` (the default), its cost model then chooses the length from this drafter's
measured acceptance by position and T(k). The run counts every emitted token, drafted by this
drafter or not: as auto's candidate it is verified only on the steps auto gives it, and a length
grown only on those stayed at ``restart`` while another copy was chosen (auto then saw a 2-token
guess against the other's 16 and never chose it: measured on whole-file edits)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome
from specdec.drafting.edits import MAX_EDITS, REACH, SYNC, Edit, apply_edits, learn_edit, spelling_variants

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
    run: int = 0  # emitted tokens that followed the prediction since the output last left it
    seen: list[int] = field(default_factory=list)  # the output so far (the emitted tokens)
    edits: list[Edit] = field(default_factory=list)  # learned from where the output left it (newest first)
    pending: list[tuple[int, int]] = field(default_factory=list)  # (predicted, output) index where it left


class PredictionDrafter(BaseDrafter):
    """Drafts the prediction from where the output is in it (module docstring). A request with
    no prediction gets no draft."""

    # A copy of text the client sent, not of this request's output: auto judges it on every step
    # and lets it set no reach class (as a datastore's retrieval).
    retrieves = True

    def __init__(self, min_match: int = 3, restart: int = 2, tokenizer: Any = None) -> None:
        if min_match < 1 or restart < 1:
            raise ValueError(f"min_match and restart must be >= 1, got {min_match} and {restart}")
        self.min_match, self.restart = min_match, restart
        self.tokenizer = tokenizer  # the target's: an edit to a word is learned for its other spellings

    def describe(self) -> str:
        return "prediction (the client's predicted output, followed through its edits)"

    def start(self, prompt_ids: torch.Tensor) -> PredictionState:
        return PredictionState()

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
        tokens, _ = self.continuation(state, min(gamma, max(2 * state.run, self.restart)))
        return Draft(torch.tensor(tokens, dtype=torch.long, device=device), None, None, drafter=PREDICTION)

    @staticmethod
    def continuation(state: PredictionState, count: int,
                     edits: list[Edit] | None = None) -> tuple[list[int], list[int | None]]:
        """The next ``count`` tokens the prediction says from the pointer, ``edits`` (the learned
        ones unless given) made, and where each lies from the pointer (None: an edit put it there).
        The output's last tokens go first, so that an edit whose anchor was emitted already goes on."""
        edits = state.edits if edits is None else edits
        pointer = state.pointer or 0  # (callers ask only while it is in the prediction)
        copied = state.predicted[pointer : pointer + count + 2 * REACH]
        if not edits:
            return copied[:count], list(range(min(count, len(copied))))
        longest = max(len(edit.after) for edit in edits)
        tokens, origins = apply_edits(state.seen[-longest:], copied, edits)
        return tokens[:count], origins[:count]

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        state = self.state(request)
        if state is None:
            return
        for token in outcome.emitted.tolist():
            expected, origins = self.continuation(state, 2) if state.pointer is not None else ([], [])
            if expected and expected[0] != token and origins[0] is None:
                # an edit made ahead was wrong here (a change the output made once): forget each edit
                # without which the prediction says this token, and follow the plain copy
                state.edits = [edit for edit in state.edits
                               if self.continuation(state, 1, [e for e in state.edits if e is not edit])[0] != [token]]
                expected, origins = self.continuation(state, 2)
            if expected and expected[0] == token:
                # past a copied token, or past an edit's token onto the copy that follows it
                step = origins[0] + 1 if origins[0] is not None else next(
                    (origin for origin in origins[1:] if origin is not None), 0)
                state.pointer = (state.pointer or 0) + step
                state.run += 1
                state.seen.append(token)
                continue
            if expected and origins[0] == 0:  # it left a plain copy here: perhaps an edit to learn
                state.pending.append((state.pointer or 0, len(state.seen)))
            state.seen.append(token)
            state.anchor = state.anchor if state.pointer is None else state.pointer
            state.pointer = self.rejoin(state)
            state.run = 0
        self.learn(state)

    def learn(self, state: PredictionState) -> None:
        """The edits of the places the output left the prediction, once the output is long enough
        past them to tell (learn_edit on the prediction followed by the output)."""
        ready = [(at, output_at) for at, output_at in state.pending if len(state.seen) >= output_at + REACH + SYNC]
        if not ready:
            return
        state.pending = state.pending[len(ready):]  # (in output order: the ready ones come first)
        both = state.predicted + state.seen
        for at, output_at in ready:
            edit = learn_edit(both, at, len(state.predicted) + output_at)
            for learned in ([edit, *spelling_variants(self.tokenizer, edit)] if edit is not None else []):
                if learned not in state.edits:
                    state.edits = [learned, *state.edits][:MAX_EDITS]

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
