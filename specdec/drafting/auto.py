"""``auto``: every drafter available for a target is a candidate at every step, and one cost model
picks the step's draft (whose, and how long), or none when no draft pays.

Candidates come in two kinds. Drafters that copy from text (suffix, n-gram, ngram-edit) cost
microseconds: each drafts every step, and each is judged on every step's outcome whether it was
verified or not (its guess is compared with the tokens the target emitted: the count it would have
had accepted; for sampling, a point-mass guess x is accepted with probability p(x), the chance
that the target's own draw is x, so the comparison estimates the same rate). Drafters that run a
forward (a draft head, a draft model) cost real time: they draft only when chosen, and one left
idle gets a probe, two steps in a row, so its estimate stays alive (the idle steps between probes
grow with what a probe costs: the one probe rule, estimates.CostModel.probe_period). A forward
candidate's seconds per token are
measured on steps that follow one it drafted too: a step after idle ones first feeds it their
tokens (a head: every token since it last drafted), a cost it pays only because it sat idle.

The cost model (Leviathan et al. 2023, with measured costs; p = target, q = draft): a draft of g
tokens from candidate c is worth E_c(g) expected tokens, 1 + the sum of its reaches (c's acceptance by
position on this request, the pooled estimate over earlier requests as its prior, both kept apart
by the step's reach class: how far the shortest copy reaches) and costs
g * (c's seconds per drafted token) + T(g + 1), with T(k) the measured seconds of a k-token verify
block of the step's batch (the engine's one cost model, where the engine records every step's
T); no draft is worth 1 token for T(1). The highest expected tokens per second wins.

In a constrained request, a text candidate's draft is cut where the grammar refuses it before
the choice (as the engine would cut it), so it is chosen and judged on what could be verified.

Lossless like every drafter: the choice reads only the context and earlier steps' outcomes, never
the draws that verify this step; the chosen draft is verified as it would be alone (a head's q,
point masses for copied text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specdec.core.drafts import (
    NO_DRAFT,
    BaseDrafter,
    Draft,
    Drafter,
    DraftRequest,
    ReadsHidden,
    StepOutcome,
    describe_drafter,
    propose_many,
    suffix_caches,
)
from specdec.core.estimates import AcceptanceByPosition, CostModel, DraftCost, ProbeRule, tokens_per_second
from specdec.drafting.merge import SubRequest
from specdec.drafting.model import common_prefix

# How far every copy reaches this step (its shortest draft) sorts steps into classes, each with its
# own acceptance: where one copy's match has run out the text is leaving the copy, and a long guess
# from another is worth less there than where all of them reach far.
REACH_CLASSES = (4, 8)  # shortest copy < 4, 4-7, 8+ tokens
# A copy's own reach (its draft's length, which grows with the length of its match) splits its
# estimates once more, by the same bounds: a 2-token copy (a 2-token match) among short copies is
# accepted far less than a 9-token one among them (default pair, bundled suite: suffix's 2-token
# drafts there 16%, a head's first token 48%).
CLASSES = (len(REACH_CLASSES) + 1) ** 2  # (the step's reach class, a copy's own)


@dataclass
class Candidate:
    """One drafter auto may pick, and what is measured of it across requests."""

    name: str
    drafter: Drafter
    copies_text: bool  # drafts every step for free, judged on every outcome (no forward of its own)
    # its draft's length sets the step's reach class: a copy of this request's text (a corpus
    # drafter's retrieval is judged in every class but sets none: its reach says nothing of this text)
    sets_reach: bool
    pooled: list[AcceptanceByPosition]  # [class]: acceptance by position over every request, each request's prior
    # seconds per token of its drafts that first fed a backlog (until steady ones are measured)
    cold_cost: DraftCost = field(default_factory=DraftCost)


@dataclass
class AutoState:
    """One request's auto state: each candidate's own state and acceptance, this step's free drafts."""

    states: list[Any]
    acceptance: list[list[AcceptanceByPosition]]  # [candidate][reach class]
    shadows: list[list[int] | None]  # this step's draft of each text candidate (None: forward candidates)
    chosen: int | None = None  # the candidate whose draft this step verifies
    idle: list[ProbeRule] = field(default_factory=list)  # steps since each candidate last drafted
    sets_reach: list[bool] = field(default_factory=list)  # [candidate]: Candidate.sets_reach
    previous: int | None = None  # the candidate whose draft the request's previous step verified
    follow_up: int | None = None  # a probe's candidate, which drafts this step again (its steady cost)

    @property
    def reach_class(self) -> int:
        """This step's class: how far the shortest copy of the request's text reaches (0 without copies)."""
        lengths = [len(shadow) for shadow, sets in zip(self.shadows, self.sets_reach, strict=True)
                   if shadow is not None and sets]
        return sum(min(lengths) >= bound for bound in REACH_CLASSES) if lengths else 0

    def class_of(self, index: int) -> int:
        """Candidate ``index``'s class this step: the step's reach class and, for a copy, its own reach."""
        shadow = self.shadows[index]
        own = sum(len(shadow) >= bound for bound in REACH_CLASSES) if shadow is not None else 0
        return self.reach_class * (len(REACH_CLASSES) + 1) + own

    def estimates(self, index: int) -> AcceptanceByPosition:
        """Candidate ``index``'s acceptance by position in its class this step."""
        return self.acceptance[index][self.class_of(index)]


@dataclass(frozen=True)
class Choice:
    candidate: int | None  # None: no draft
    length: int
    rate: float | None  # expected tokens per second; None where a cost is not measured yet
    probe: bool = False  # drafted to measure the candidate, not because it pays: it drafts next step too


class AutoDrafter(BaseDrafter):
    """Picks, each step and for each request, the candidate draft with the highest expected tokens
    per second (see the module docstring). ``candidates`` maps a name (what stats and metrics
    show) to a drafter; ``text_drafters`` names those that only copy text. ``costs``: the cost
    model it decides with, its engine's (Engine takes it from here; None: a fresh one), whose
    clock times its candidates' drafts."""

    default_policy = "auto"  # it chooses each step's length itself: the policy only caps it
    names_drafts = True  # each draft says which candidate drafted it, or NO_DRAFT

    def __init__(self, candidates: Mapping[str, Drafter], text_drafters: Sequence[str], max_gamma: int = 16,
                 costs: CostModel | None = None) -> None:
        if not candidates:
            raise ValueError("the auto drafter needs at least one candidate drafter")
        if any(name == NO_DRAFT for name in candidates):
            raise ValueError(f"{NO_DRAFT!r} names the choice of no draft, not a candidate")
        vocabularies = {d.vocab_size for d in candidates.values() if d.vocab_size is not None}
        if len(vocabularies) > 1:
            raise ValueError(f"the auto drafter's candidates have different vocabularies: {sorted(vocabularies)}")
        readers = [d for d in candidates.values() if d.hidden_layers]
        if len({d.hidden_layers for d in readers}) > 1:
            raise ValueError("the auto drafter's candidates read different target layers; give it at most one head")
        # T(batch, k) of this target and each forward candidate's seconds per token, shared by every request
        self.costs = costs if costs is not None else CostModel()
        self.candidates = [Candidate(name, drafter, name in text_drafters,
                                     name in text_drafters and not getattr(drafter, "retrieves", False),
                                     [self.costs.acceptance(max_gamma) for _ in range(CLASSES)],
                                     DraftCost(self.costs.decay))
                           for name, drafter in candidates.items()]
        self.vocab_size = vocabularies.pop() if vocabularies else None
        self.hidden_layers = readers[0].hidden_layers if readers else ()
        self.max_gamma = max_gamma

    def describe(self) -> str:
        """One short line (a banner's, a table's title): the candidates by name; each one's own
        description is describe_candidates()'s."""
        return f"auto: each step the best of {', '.join(c.name for c in self.candidates)}, or none"

    def describe_candidates(self) -> list[str]:
        """Each candidate in words, a line each."""
        return [f"{c.name}: {describe_drafter(c.drafter)}" for c in self.candidates]

    def start(self, prompt_ids: torch.Tensor) -> AutoState:  # prompt_ids [n] int64
        return AutoState(
            states=[c.drafter.start(prompt_ids) for c in self.candidates],
            acceptance=[[self.costs.acceptance(self.max_gamma, prior=pooled) for pooled in c.pooled]
                        for c in self.candidates],
            shadows=[None] * len(self.candidates),
            idle=[ProbeRule() for _ in self.candidates],
            sets_reach=[c.sets_reach for c in self.candidates],
        )

    def member(self, request: DraftRequest, index: int) -> SubRequest:
        return SubRequest(request, request.draft_state.states[index])

    # The choice.

    def rates(self, state: AutoState, index: int, most: int, verify: list[float | None]) -> list[Choice]:
        """Expected tokens per second of drafting 1..most tokens with candidate ``index``, where
        ``verify[k]`` is T(k + 1) (the alphas and T computed once a step: this runs every step)."""
        per_token = self.draft_seconds(index)
        choices, expected = [], 1.0
        for length, reach in enumerate(state.estimates(index).reaches(most), start=1):
            expected += reach
            choices.append(Choice(index, length, tokens_per_second(expected, length, per_token, verify[length])))
        return choices

    def draft_seconds(self, index: int) -> float | None:
        """Candidate ``index``'s seconds per drafted token: 0 for text, steady ones where measured."""
        candidate = self.candidates[index]
        if candidate.copies_text:
            return 0.0
        steady = self.costs.draft(candidate.name).seconds()
        return steady if steady is not None else candidate.cold_cost.seconds()

    def choose(self, state: AutoState, gamma: int, batch: int = 1) -> Choice:
        """The best (candidate, length) for this step of ``batch`` requests, given the free drafts
        in ``state.shadows``."""
        curve = self.costs.verify.curve(batch)
        verify = [None if curve is None else curve(block) for block in range(1, gamma + 2)]  # [k]: T(k + 1)
        options = [Choice(None, 0, tokens_per_second(1.0, 0, 0.0, verify[0]))]
        untried = []  # forward candidates whose drafting cost is not measured yet
        for index, shadow in enumerate(state.shadows):
            if self.draft_seconds(index) is None:
                untried.append(index)
            else:
                options += self.rates(state, index, len(shadow) if shadow is not None else gamma, verify)
        if untried:  # measure what it costs: its default length, then a steady step
            return Choice(untried[0], min(gamma, 4), None, probe=True)
        if any(option.rate is None for option in options):  # T(k) not measured yet: the longest free draft
            longest = max(options, key=lambda option: option.length)
            return replace(longest, rate=None)
        best = max(options, key=lambda option: option.rate or 0.0)
        if state.follow_up is not None:  # a probe's second step: its best length, at least one token
            return self.best_of(state.follow_up, options)
        stale = [index for index, candidate in enumerate(self.candidates)
                 if not candidate.copies_text and index != best.candidate
                 # (its probe: two one-token drafts, the one probe rule's period)
                 and state.idle[index].due(self.costs.probe_period(self.draft_seconds(index), batch, steps=2,
                                                                   curve=curve))]
        if stale:  # a probe keeps its estimate alive
            return replace(self.best_of(stale[0], options), probe=True)
        return best

    @staticmethod
    def best_of(index: int, options: list[Choice]) -> Choice:
        """Candidate ``index``'s best option, at least one token."""
        return max((option for option in options if option.candidate == index),
                   key=lambda option: option.rate or 0.0, default=Choice(index, 1, None))

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        return self.propose_many([request], [gamma])[0]

    def propose_many(self, requests: Sequence[DraftRequest], gammas: Sequence[int]) -> list[Draft]:
        """Every text candidate drafts for every request; each request's choice is made; the forward
        candidates chosen draft for their requests in one call each (a head: one forward per depth)."""
        free: list[list[Draft | None]] = []  # [request][candidate]: the text candidates' drafts
        for request, gamma in zip(requests, gammas, strict=True):
            state: AutoState = request.draft_state
            own: list[Draft | None] = [
                candidate.drafter.propose(self.member(request, index), gamma) if candidate.copies_text else None
                for index, candidate in enumerate(self.candidates)]
            if request.matcher is not None:  # what the grammar lets through (as the engine cuts a copied chain)
                own = [None if draft is None else draft.truncated(request.matcher.valid_prefix(draft.tokens.tolist()))
                       for draft in own]
            state.shadows = [None if draft is None else draft.tokens.tolist() for draft in own]
            free.append(own)
        choices = [self.choose(request.draft_state, gamma, len(requests))
                   for request, gamma in zip(requests, gammas, strict=False)]
        result = [Draft.empty(request.context.device) for request in requests]
        for position, (request, choice) in enumerate(zip(requests, choices, strict=False)):
            request.draft_state.chosen = choice.candidate
            request.draft_state.follow_up = choice.candidate if choice.probe else None
            if choice.candidate is not None and (copied := free[position][choice.candidate]) is not None:
                result[position] = replace(copied.truncated(choice.length),
                                           drafter=self.candidates[choice.candidate].name)
        for index, candidate in enumerate(self.candidates):
            asking = [position for position, choice in enumerate(choices)
                      if choice.candidate == index and not candidate.copies_text]
            if not asking:
                continue
            began = self.costs.clock()
            drafts = propose_many(candidate.drafter, [self.member(requests[p], index) for p in asking],
                                  [choices[p].length for p in asking])
            drafted = sum(draft.num_nodes for draft in drafts)  # type: int
            # Steady only where every request drafted with it on its previous step (a backlog of one step).
            steady = all(requests[p].draft_state.previous == index for p in asking)
            cost = self.costs.draft(candidate.name) if steady else candidate.cold_cost
            cost.add(self.costs.clock() - began, drafted)
            for position, draft in zip(asking, drafts, strict=False):
                result[position] = replace(draft, drafter=candidate.name)
        return [draft if draft.num_nodes else replace(draft, drafter=NO_DRAFT) for draft in result]

    # What each step teaches.

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        state: AutoState = request.draft_state
        if not outcome.forced:  # (the step's verify seconds: recorded by the engine, at its batch)
            emitted = outcome.emitted.tolist()
            for index, candidate in enumerate(self.candidates):
                # A chosen copy is judged on its whole free draft too: the step's last token says whether
                # its guess one past the verified length was right (a copy verified 8 tokens at a time
                # otherwise never learns of its 9th, and auto kept choosing 8 where 16 were all right).
                if index == state.chosen and outcome.num_drafted and (state.shadows[index] is None
                                                                      or outcome.parents is not None):
                    learned: tuple[int, int] | None = (outcome.num_drafted, outcome.num_accepted)
                else:
                    learned = judged(state.shadows[index], emitted)
                if learned is not None:
                    state.estimates(index).update(*learned)
                    candidate.pooled[state.class_of(index)].update(*learned)
                state.idle[index].observe(index == state.chosen)
        # Only the drafter whose draft was verified hears of it; the others hear the new tokens.
        elsewhere = replace(outcome, num_drafted=0, path=None, parents=None, from_cache=None)
        for index, candidate in enumerate(self.candidates):
            candidate.drafter.observe(self.member(request, index), outcome if index == state.chosen else elsewhere)
        state.previous, state.chosen, state.shadows = state.chosen, None, [None] * len(self.candidates)

    def prefilled(self, request: DraftRequest, hidden: torch.Tensor) -> None:  # hidden [prompt - 1, features]
        for index, candidate in enumerate(self.candidates):
            if candidate.drafter.hidden_layers:
                reader: ReadsHidden = candidate.drafter  # type: ignore[assignment]
                reader.prefilled(self.member(request, index), hidden)

    def suffix_caches(self) -> list[Any]:
        return [cache for candidate in self.candidates for cache in suffix_caches(candidate.drafter)]


def judged(guess: list[int] | None, emitted: list[int]) -> tuple[int, int] | None:
    """(drafted, accepted) that a chain ``guess`` not verified this step would have had, read off the
    tokens the target emitted: accepted up to its first token that differs from them; where it
    agrees with all of them, only that much is known (a longer guess is judged on what was seen).
    Judging only the first token (every step reaches it; deeper ones only after easy text) was
    tried: it starved the deeper positions of a copy, where a copy that started goes on, and auto's
    drafts fell short (measured on the real pair: docs/design.md, "auto")."""
    if not guess:
        return None
    agree = common_prefix(guess, emitted)
    if agree < min(len(guess), len(emitted)):
        return len(guess), agree  # rejected at its first difference
    return agree, agree
