"""Drafters built on a draft head (drafting/head.py): ``head`` drafts a chain, ``head-tree`` a
dynamic tree (EAGLE-2: the nodes with the highest cumulative draft probability, grow_tree).

q is the head's softmax over its draft vocabulary mapped into the target's (zero outside it), after
the request's sampling settings, so verification stays exact; greedy drafts take the argmax.
"""

from __future__ import annotations

import torch

from specdec.drafting.base import BaseDrafter, Draft, DraftRequest, StepOutcome
from specdec.drafting.head import DraftHead
from specdec.drafting.model import draft_chain
from specdec.drafting.tree import check_tree_shape, draft_distribution, grow_tree
from specdec.models.base import Attention, Segment, tree_depths


class HeadState:
    """One request's head cache and the (target features, next token) pairs not yet fed to it.

    Invariant: the cache's first ``fed`` entries are pairs (target features at t, token t + 1)
    for t = 0 .. fed - 1; entries past them are the last draft's, dropped by the next feed_pending().
    ``root_logits`` / ``root_features`` are the head's output at the last fed pair: q for the
    first draft token and the features the second draft position reads."""

    def __init__(self, head: DraftHead, max_context: int) -> None:
        self.head = head
        self.cache = head.new_cache(max_context)
        self.fed = 0
        self.pending_tokens: list[torch.Tensor] = []  # [m] int64 pieces
        self.pending_hidden: list[torch.Tensor] = []  # [m, features] pieces, the target's
        self.root_logits: torch.Tensor | None = None  # [1, vocab]
        self.root_features: torch.Tensor | None = None  # [1, hidden]

    def queue(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:  # [m], [m, features]
        if hidden is None or hidden.shape[0] != tokens.shape[0]:
            raise ValueError("a head drafter needs the target's hidden states of every emitted token "
                             "(run it with the engine, which asks the target for its hidden_layers)")
        self.pending_tokens.append(tokens)
        self.pending_hidden.append(hidden)

    def feed_pending(self) -> bool:
        """Feed the queued pairs (one chain forward, committed); False when there is nothing to draft from."""
        self.cache.rollback(0, self.fed)  # the last draft's entries: only target-feature pairs stay
        if self.pending_tokens:
            tokens, hidden = torch.cat(self.pending_tokens), torch.cat(self.pending_hidden)
            self.pending_tokens, self.pending_hidden = [], []
            positions = torch.arange(self.fed, self.fed + tokens.shape[0], device=tokens.device)
            logits, features = self.head(tokens, self.head.fuse(hidden), positions, self.cache,
                                         Attention.chain(tokens.shape[0], batch_invariant=False))
            self.cache.commit(0, tokens.shape[0])
            self.fed += tokens.shape[0]
            self.root_logits, self.root_features = self.to_target(logits[-1:]), features[-1:]
        return self.root_logits is not None

    def to_target(self, draft_logits: torch.Tensor) -> torch.Tensor:  # [n, draft_vocab] -> [n, vocab]
        """Logits over the target's vocabulary: -inf outside the draft vocabulary (q = 0 there)."""
        logits = draft_logits.new_full((draft_logits.shape[0], self.head.config.vocab_size), float("-inf"))
        return logits.index_copy_(1, self.head.draft_token_ids, draft_logits)


class HeadDrafter(BaseDrafter):
    """Drafts a chain with a draft head, one head forward per token."""

    def __init__(self, head: DraftHead, max_context: int) -> None:
        self.head, self.max_context = head, max_context
        self.vocab_size = head.config.vocab_size
        self.hidden_layers = head.config.feature_layers

    def describe(self) -> str:
        return f"EAGLE-3 head ({self.head.config.draft_vocab_size}-token draft vocabulary)"

    def start(self, prompt_ids: torch.Tensor) -> HeadState:
        return HeadState(self.head, self.max_context)

    def prefilled(self, request: DraftRequest, hidden: torch.Tensor) -> None:  # hidden [prompt - 1, features]
        request.draft_state.queue(request.context[1 : hidden.shape[0] + 1], hidden)

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        request.draft_state.queue(outcome.emitted, outcome.hidden)

    def room(self, state: HeadState, count: int) -> int:
        """count clamped to the head cache's free entries (after feed_pending)."""
        return max(0, min(count, self.max_context - state.fed))

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        state: HeadState = request.draft_state
        device = request.context.device
        if gamma <= 0 or not state.feed_pending() or (gamma := self.room(state, gamma)) == 0:
            return Draft.empty(device)
        features = state.root_features

        def next_logits(tokens: torch.Tensor) -> torch.Tensor:  # [k] -> [1, vocab]; each reads the last output
            nonlocal features
            for token in tokens.split(1):
                position = torch.tensor([state.cache.lengths[0]], device=device)
                draft_logits, features = self.head(token, features, position, state.cache,
                                                   Attention.chain(1, batch_invariant=False))
                state.cache.commit(0, 1)  # dropped again by the next feed_pending()
            return state.to_target(draft_logits)

        return draft_chain(state.root_logits, next_logits, gamma, request)


class HeadTreeDrafter(HeadDrafter):
    """Drafts a tree with a draft head (grow_tree, as EAGLE-2): one head forward per depth, each
    node reading its parent's output features."""

    def __init__(self, head: DraftHead, max_context: int, budget: int = 16, branching: int = 4) -> None:
        check_tree_shape(budget, branching)
        super().__init__(head, max_context)
        self.budget, self.branching = budget, branching

    def describe(self) -> str:
        return f"{super().describe()} tree, up to {self.budget} nodes"

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        state: HeadState = request.draft_state
        sampling, device = request.sampling, request.context.device
        if (
            gamma <= 0
            or not state.feed_pending()
            or (budget := self.room(state, request.node_budget or self.budget)) == 0
        ):
            return Draft.empty(device)
        node_features: list[torch.Tensor] = []  # [hidden] per node: the head's output there

        def expand(tokens: list[int], parents: list[int], new_nodes: list[int]) -> torch.Tensor:
            written = new_nodes[0]
            depths = tree_depths(parents)
            positions = torch.tensor([state.fed + depths[node] for node in new_nodes], device=device)
            block = torch.tensor(tokens[written:], dtype=torch.long, device=device)
            features = torch.cat(
                [state.root_features if parents[node] < 0 else node_features[parents[node]][None] for node in new_nodes]
            )
            segment = Segment(0, len(new_nodes), tuple(parents), written)
            draft_logits, out = self.head(block, features, positions, state.cache, Attention((segment,), False))
            node_features.extend(out)
            return draft_distribution(state.to_target(draft_logits), sampling)

        return grow_tree(
            draft_distribution(state.root_logits, sampling), expand, gamma, budget, self.branching, request
        )
