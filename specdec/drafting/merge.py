"""Several drafters at once: their proposals merged into one token tree (shared prefixes once),
verified in one target forward. For example the n-gram drafter and a draft model: the n-gram
wins on repeated text, the model elsewhere, and the target's single pass picks whichever agrees.

The merged tree is verified with point masses (no q): a node from one drafter and its sibling
from another were not drawn without replacement from one q, so recursive rejection sampling
with q would not apply. The point-mass rule accepts a guess x with probability p(x) and keeps
the target's law exactly for any guesses made without looking at the target's random draws;
when greedy nothing changes. Each drafter keeps its own state and sees the outcome as usual.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from specdec.core.drafts import (
    BaseDrafter,
    Draft,
    Drafter,
    DraftRequest,
    ReadsHidden,
    StepOutcome,
    StopRule,
    describe_drafter,
    node_paths,
    propose_many,
    suffix_caches,
)
from specdec.core.rules import SamplingRule
from specdec.core.sampling import SamplingParams
from specdec.drafting.ngram import merge_branches


@dataclass
class SubRequest:
    """One member drafter's view of a request: the request, with that drafter's own state."""

    request: DraftRequest
    draft_state: Any

    @property
    def context(self) -> torch.Tensor:
        return self.request.context

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def rule(self) -> SamplingRule:
        return self.request.rule

    @property
    def stop_early(self) -> StopRule | None:
        return self.request.stop_early

    @property
    def node_budget(self) -> int | None:
        return self.request.node_budget

    @property
    def matcher(self) -> Any:
        return self.request.matcher


def root_paths(draft: Draft) -> list[list[int]]:
    """A draft as the token paths from the root to each leaf, in node order."""
    tokens = draft.tokens.tolist()
    parents = list(draft.parents) if draft.parents is not None else list(range(-1, len(tokens) - 1))
    has_child = set(parents)
    return [list(path) for node, path in enumerate(node_paths(tokens, parents)) if node not in has_child]


def cache_flags(drafts: Sequence[Draft], tokens: list[int], parents: list[int]) -> tuple[bool, ...] | None:
    """Draft.from_cache of the merged tree: a node is owed to the cache when some drafter's
    cache-guessed node has its root path and no other drafter's node has it too."""
    if all(draft.from_cache is None for draft in drafts):
        return None
    cached: set[tuple[int, ...]] = set()  # root paths some drafter guessed from the cache
    plain: set[tuple[int, ...]] = set()  # root paths some drafter guessed otherwise
    for draft in drafts:
        chain = list(range(-1, draft.num_nodes - 1))
        paths = node_paths(draft.tokens.tolist(), chain if draft.parents is None else draft.parents)
        flags = draft.from_cache or (False,) * len(paths)
        for path, flag in zip(paths, flags, strict=True):
            (cached if flag else plain).add(path)
    return tuple(path in cached and path not in plain for path in node_paths(tokens, parents))


class MergedDrafter(BaseDrafter):
    """Runs each drafter and merges the proposals into one tree of at most ``budget`` nodes,
    taking root-to-leaf paths from the drafters in turns until the budget runs out."""


    def __init__(self, drafters: Sequence[Drafter], budget: int = 24) -> None:
        if len(drafters) < 2:
            raise ValueError("a merged drafter needs at least two drafters")
        vocabularies = {d.vocab_size for d in drafters if d.vocab_size is not None}
        if len(vocabularies) > 1:
            raise ValueError(f"the merged drafters have different vocabularies: {sorted(vocabularies)}")
        self.drafters, self.budget = list(drafters), budget
        readers = [d for d in drafters if d.hidden_layers]
        if len({d.hidden_layers for d in readers}) > 1:
            raise ValueError("the merged drafters read different target layers; merge at most one head")
        self.hidden_layers = readers[0].hidden_layers if readers else ()

    def describe(self) -> str:
        return " + ".join(describe_drafter(d) for d in self.drafters) + f", merged into one tree ({self.budget} nodes)"

    def start(self, prompt_ids: torch.Tensor) -> list[Any]:
        return [drafter.start(prompt_ids) for drafter in self.drafters]

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        return self.propose_many([request], [gamma])[0]

    def propose_many(self, requests: Sequence[DraftRequest], gammas: Sequence[int]) -> list[Draft]:
        """Each member drafts for every request (in one call where it batches), then each
        request's drafts are merged."""
        member_drafts = [propose_many(drafter, [SubRequest(request, request.draft_state[member])
                                                for request in requests], gammas)
                         for member, drafter in enumerate(self.drafters)]
        return [self.merge(request, list(drafts))
                for request, drafts in zip(requests, zip(*member_drafts, strict=True), strict=True)]

    def merge(self, request: DraftRequest, drafts: list[Draft]) -> Draft:
        device = request.context.device
        proposals = [root_paths(draft) for draft in drafts]
        # Paths taken in turns from each drafter, so that one big tree cannot use up the budget.
        paths = [path for turn in itertools.zip_longest(*proposals) for path in turn if path is not None]
        tokens, parents = merge_branches(paths, request.node_budget or self.budget)
        if not tokens:
            return Draft.empty(device)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=device), None, tuple(parents),
                     from_cache=cache_flags(drafts, tokens, parents))

    def suffix_caches(self) -> list[Any]:
        return [cache for drafter in self.drafters for cache in suffix_caches(drafter)]

    def prefilled(self, request: DraftRequest, hidden: torch.Tensor) -> None:  # hidden [prompt - 1, features]
        for drafter, state in zip(self.drafters, request.draft_state, strict=True):
            if drafter.hidden_layers:
                cast(ReadsHidden, drafter).prefilled(SubRequest(request, state), hidden)

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        for drafter, state in zip(self.drafters, request.draft_state, strict=True):
            drafter.observe(SubRequest(request, state), outcome)
