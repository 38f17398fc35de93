"""Drafters built on a draft head (drafting/head.py): ``head`` drafts a chain, ``head-tree`` a
dynamic tree (EAGLE-2: the nodes with the highest cumulative draft probability, tree_steps).

q is the head's softmax over its draft vocabulary mapped into the target's (zero outside it), after
the request's sampling settings, so verification stays exact; greedy drafts take the argmax over the
draft vocabulary's logits alone (LogitColumns), mapped to the target's token ids.

Every request of an engine step drafts in lockstep (drafting/lockstep.py): one head forward feeds
them all the target's new features, then one head forward per depth scores every request's next
token (a chain) or next depth of nodes (a tree). Each request has its own row of the drafter's
head cache, and the head scores each row as it would alone (DraftHead.forward's batch
invariance), so a request's drafts, and so its seeded samples, never depend on its neighbours.

A head reads only the last ``prompt_window`` tokens of a prompt: the heads are trained on windows
of a few hundred tokens, and feeding a whole 16k-token file ran the head's layer over all of it,
each position attending to every one before it, at the first draft (a decode-time cost several
times the rest of the decode at 16k tokens). Positions count from the window's start; rotary
attention depends only on the distance between positions, so this is the head's view of a
prompt that began there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome
from specdec.core.sampling import SamplingParams
from specdec.drafting.head import DraftHead
from specdec.drafting.lockstep import run_in_lockstep
from specdec.drafting.model import LogitColumns, chain_steps
from specdec.drafting.tree import NewNodes, check_tree_shape, draft_distribution, tree_steps
from specdec.models.base import Attention, Segment, tree_depths
from specdec.models.cache import RowPool


class HeadState:
    """One request's row of the head cache and the (target features, next token) pairs not yet fed.

    Invariant: the row's first ``fed`` entries are pairs (target features at t, token t + 1) for
    t = 0 .. fed - 1; entries past them are the last draft's, dropped by the next feed.
    ``root_logits`` / ``root_features`` are the head's output at the last fed pair: q for the
    first draft token and the features the second draft position reads."""

    def __init__(self, rows: RowPool) -> None:
        self.row = rows.lend(self)  # free again once the request is gone
        self.fed = 0
        self.pending_tokens: list[torch.Tensor] = []  # [m] int64 pieces
        self.pending_hidden: list[torch.Tensor] = []  # [m, features] pieces, the target's
        self.root_logits: torch.Tensor | None = None  # [1, draft_vocab]
        self.root_features: torch.Tensor | None = None  # [1, hidden]

    def root(self) -> tuple[torch.Tensor, torch.Tensor]:  # logits [1, draft_vocab], features [1, hidden]
        """What the last feed left: the first draft token's logits, the features the next position reads."""
        if self.root_logits is None or self.root_features is None:
            raise RuntimeError("a head drafts from a request only after a feed")
        return self.root_logits, self.root_features

    def queue(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:  # [m], [m, features]
        if hidden is None or hidden.shape[0] != tokens.shape[0]:
            raise ValueError("a head drafter needs the target's hidden states of every emitted token "
                             "(run it with the engine, which asks the target for its hidden_layers)")
        self.pending_tokens.append(tokens)
        self.pending_hidden.append(hidden)


#: The prompt tokens a head reads (the last ones): twice the heads' training windows (256 tokens).
PROMPT_WINDOW = 512


class HeadDrafter(BaseDrafter):
    """Drafts a chain with a draft head, one head forward per token for every request at once."""

    def __init__(self, head: DraftHead, max_context: int, prompt_window: int = PROMPT_WINDOW) -> None:
        if prompt_window < 1:
            raise ValueError(f"a head reads at least one prompt token (prompt_window {prompt_window})")
        self.head, self.max_context, self.prompt_window = head, max_context, prompt_window
        self.vocab_size = head.config.vocab_size
        self.hidden_layers = head.config.feature_layers
        self.rows = RowPool(head.new_cache(max_context))  # one row per request drafting; more as needed
        self.cache = self.rows.cache
        self.device = head.d2t.device
        self.columns = LogitColumns(head.draft_token_ids, head.config.vocab_size)  # what the head's logits are over

    def describe(self) -> str:
        return f"EAGLE-3 head ({self.head.config.draft_vocab_size}-token draft vocabulary)"

    def start(self, prompt_ids: torch.Tensor) -> HeadState:
        return HeadState(self.rows)

    def prefilled(self, request: DraftRequest, hidden: torch.Tensor) -> None:  # hidden [prompt - 1, features]
        start = max(0, hidden.shape[0] - self.prompt_window)  # only the window's pairs are fed
        request.draft_state.queue(request.context[start + 1 : hidden.shape[0] + 1], hidden[start:])

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        request.draft_state.queue(outcome.emitted, outcome.hidden)

    def feed(self, states: Sequence[HeadState]) -> None:
        """Drop each row's last draft and feed every request's queued pairs, in one forward (committed)."""
        for state in states:
            self.cache.rollback(state.row, state.fed)
        feeding = [state for state in states if state.pending_tokens]
        if not feeding:
            return
        blocks = [torch.cat(state.pending_tokens) for state in feeding]
        hidden = torch.cat([piece for state in feeding for piece in state.pending_hidden])  # [sum m, features]
        positions = torch.cat([torch.arange(state.fed, state.fed + block.shape[0], device=block.device)
                               for state, block in zip(feeding, blocks, strict=True)])
        attention = Attention(tuple(Segment(state.row, block.shape[0])
                                    for state, block in zip(feeding, blocks, strict=True)))
        last_rows = torch.tensor(attention.offsets[1:], device=self.device) - 1  # only they are drafted from
        logits, features = self.head(torch.cat(blocks), self.head.fuse(hidden, batch_invariant=True), positions,
                                     self.cache, attention, logit_rows=last_rows)
        for index, (state, block, end) in enumerate(zip(feeding, blocks, attention.offsets[1:], strict=True)):
            self.cache.commit(state.row, block.shape[0])
            state.fed += block.shape[0]
            state.pending_tokens, state.pending_hidden = [], []
            state.root_logits, state.root_features = logits[index : index + 1], features[end - 1 : end]

    def drafting(self, requests: Sequence[DraftRequest], gammas: Sequence[int],
                 budget: int | None = None) -> list[tuple[int, int]]:
        """Feed every request; (index, depth or node limit) of those that draft: gamma > 0, and
        room left in the head cache (``budget`` per request instead of gamma, for trees)."""
        self.feed([request.draft_state for request in requests])
        drafting = []
        for index, (request, gamma) in enumerate(zip(requests, gammas, strict=True)):
            state: HeadState = request.draft_state
            wanted = gamma if budget is None else request.node_budget or budget
            limit = max(0, min(wanted, self.max_context - state.fed))
            if gamma > 0 and limit > 0 and state.root_logits is not None:
                drafting.append((index, limit))
        return drafting

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        return self.propose_many([request], [gamma])[0]

    def propose_many(self, requests: Sequence[DraftRequest], gammas: Sequence[int]) -> list[Draft]:
        drafts = [Draft.empty(request.context.device) for request in requests]
        drafting = self.drafting(requests, gammas)
        states: list[HeadState] = [requests[index].draft_state for index, _ in drafting]
        features = [state.root()[1] for state in states]  # [1, hidden] each: what the next position reads
        routines = [chain_steps(state.root()[0], gamma, requests[index], self.columns)
                    for state, (index, gamma) in zip(states, drafting, strict=True)]

        def score(asking: list[int], blocks: list[torch.Tensor]) -> list[torch.Tensor]:  # [k] -> [1, draft_vocab]
            # A block of forced tokens goes one token per forward: each position reads the output before it.
            logits: list[torch.Tensor] = [torch.empty(0)] * len(asking)
            for depth in range(max(block.shape[0] for block in blocks)):
                live = [i for i, block in enumerate(blocks) if block.shape[0] > depth]
                rows = [states[asking[i]].row for i in live]
                positions = torch.tensor([self.cache.lengths[row] for row in rows], device=self.device)
                draft_logits, out = self.head(torch.cat([blocks[i][depth : depth + 1] for i in live]),
                                              torch.cat([features[asking[i]] for i in live]), positions, self.cache,
                                              Attention(tuple(Segment(row, 1) for row in rows)))
                for j, (i, row) in enumerate(zip(live, rows, strict=True)):
                    self.cache.commit(row, 1)  # dropped again by the next feed
                    features[asking[i]], logits[i] = out[j : j + 1], draft_logits[j : j + 1]
            return logits

        for (index, _), draft in zip(drafting, run_in_lockstep(routines, score), strict=True):
            drafts[index] = draft
        return drafts


class HeadTreeDrafter(HeadDrafter):
    """Drafts a tree with a draft head (tree_steps, as EAGLE-2): one head forward per depth for
    every request at once, each node reading its parent's output features."""

    def __init__(self, head: DraftHead, max_context: int, budget: int = 16, branching: int = 4,
                 prompt_window: int = PROMPT_WINDOW) -> None:
        check_tree_shape(budget, branching)
        super().__init__(head, max_context, prompt_window)
        self.budget, self.branching = budget, branching

    def describe(self) -> str:
        return f"{super().describe()} tree, up to {self.budget} nodes"

    def draft_q(self, draft_logits: torch.Tensor,  # [k, draft_vocab]
                sampling: SamplingParams) -> torch.Tensor:  # [k, draft_vocab] greedy, [k, vocab] sampling
        """draft_distribution over the draft vocabulary when greedy (the tree's top children are the
        same tokens), over the target's when sampling (verification reads q there)."""
        return draft_distribution(draft_logits if sampling.greedy else self.columns.widen(draft_logits), sampling)

    def propose_many(self, requests: Sequence[DraftRequest], gammas: Sequence[int]) -> list[Draft]:
        drafts = [Draft.empty(request.context.device) for request in requests]
        drafting = self.drafting(requests, gammas, self.budget)
        states: list[HeadState] = [requests[index].draft_state for index, _ in drafting]
        samplings = [requests[index].sampling for index, _ in drafting]
        node_features: list[list[torch.Tensor]] = [[] for _ in drafting]  # [hidden] per node: the head's output
        routines = [tree_steps(self.draft_q(state.root()[0], sampling), gammas[index], budget, self.branching,
                               requests[index], self.columns if sampling.greedy else None)
                    for state, sampling, (index, budget) in zip(states, samplings, drafting, strict=True)]

        def score(asking: list[int], questions: list[NewNodes]) -> list[torch.Tensor]:  # -> q at the new nodes each
            blocks, positions, features, segments = [], [], [], []
            for i, (tokens, parents, new_nodes) in zip(asking, questions, strict=True):
                state, written, depths = states[i], new_nodes[0], tree_depths(parents)
                blocks.append(torch.tensor(tokens[written:], dtype=torch.long, device=self.device))
                positions.append(torch.tensor([state.fed + depths[node] for node in new_nodes], device=self.device))
                features.append(torch.cat([state.root()[1] if parents[node] < 0
                                           else node_features[i][parents[node]][None] for node in new_nodes]))
                segments.append(Segment(state.row, len(new_nodes), tuple(parents), written))
            attention = Attention(tuple(segments))
            draft_logits, out = self.head(torch.cat(blocks), torch.cat(features), torch.cat(positions), self.cache,
                                          attention)
            scores = []
            for i, start, end in zip(asking, attention.offsets, attention.offsets[1:], strict=False):
                node_features[i].extend(out[start:end])
                scores.append(self.draft_q(draft_logits[start:end], samplings[i]))
            return scores

        for (index, _), draft in zip(drafting, run_in_lockstep(routines, score), strict=True):
            drafts[index] = draft
        return drafts
