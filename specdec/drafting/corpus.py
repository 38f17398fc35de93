"""``corpus`` / ``corpus-tree``: drafts retrieved from a datastore of code (REST, He et al. NAACL 2024).

The longest suffix of the context (up to ``max_n`` tokens, at least ``min_n``) that a datastore
holds is found by binary search on its suffix array (specdec.drafting.datastore); the
continuations of its occurrences (at most ``most`` of them, spread over all) are merged into a
trie with a count per node, and the draft is its most frequent path (``corpus``) or its most
frequent nodes under a node budget (``corpus-tree``): REST's rule. The counts are the draft's
confidence: a node that fewer than ``min_share`` of the occurrences continue with is left out,
and a draft is at most ``depth_per_match`` times the match's length deep. With several
datastores the longest match wins; a tie pools their continuations.

Guesses are deterministic (no q): verified as point masses, lossless when sampling, like the
suffix drafter's. A lookup costs microseconds and the datastore is only read, so one drafter (and
its memory-mapped datastores) serves every request of a server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome
from specdec.drafting.datastore import Datastore
from specdec.drafting.suffix import tree_of, trie_draft

CORPUS = "corpus"  # what Draft.drafter says of its drafts: --show and the stats mark their tokens


class CorpusDrafter(BaseDrafter):
    """Retrieval drafts from ``datastores``: see the module docstring."""

    retrieves = True  # drafts from a datastore, not the request's text (auto: it sets no reach class)

    def __init__(self, datastores: Sequence[Datastore], tree: bool = False, budget: int = 16, max_n: int = 16,
                 min_n: int = 2, most: int = 32, min_share: float = 0.2, depth_per_match: float = 2.0) -> None:
        if not datastores:
            raise ValueError("the corpus drafter needs a datastore: --index DIR (`specdec index build`)")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"match lengths need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.datastores = list(datastores)
        self.tree, self.budget, self.max_n, self.min_n = tree, budget, max_n, min_n
        self.most, self.min_share, self.depth_per_match = most, min_share, depth_per_match

    def describe(self) -> str:
        kind = f"corpus tree (up to {self.budget} nodes)" if self.tree else "corpus retrieval"
        names = ", ".join(f"{store.folder} ({store.meta.get('tokens', 0):,} tokens)" for store in self.datastores)
        return f"{kind} from {names}"

    def start(self, prompt_ids: torch.Tensor) -> None:  # prompt_ids [n] int64
        return None  # nothing per request: the context is the request's

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        pass  # the datastores are read-only

    def continuations(self, context: list[int], depth: int) -> tuple[int, list[list[int]]]:
        """(match length, continuations up to ``depth`` tokens) over every datastore: the longest
        match wins, a tie pools (length 0: no datastore holds even ``min_n`` tokens of the suffix)."""
        best, pooled = 0, list[list[int]]()
        for store in self.datastores:
            n, first, end = store.find(context, self.max_n, self.min_n)
            if n and n >= best:
                found = store.continuations(n, first, end, depth, self.most)
                pooled = found if n > best else pooled + found
                best = n
        return best, pooled

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        device = request.context.device
        if gamma <= 0:
            return Draft.empty(device)
        context = request.context[-self.max_n :].tolist()
        length, found = self.continuations(context, gamma)
        if not length:
            return Draft.empty(device)
        depth = min(gamma, math.ceil(self.depth_per_match * length))
        least = max(1, math.ceil(self.min_share * len(found)))
        budget = (request.node_budget or self.budget) if self.tree else depth
        paths = trie_draft([continuation[:depth] for continuation in found], budget, chain=not self.tree, least=least)
        if not paths:
            return Draft.empty(device)
        tokens, parents = tree_of(paths)
        draft = Draft(torch.tensor(tokens, dtype=torch.long, device=device), None,
                      tuple(parents) if self.tree else None)
        return replace(draft, drafter=CORPUS)
