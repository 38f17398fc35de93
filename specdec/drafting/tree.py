"""Token trees from a draft model: several continuations verified in one target forward.

The tree grows depth by depth under a node budget. At each depth the budget goes to the
children with the highest expected cumulative draft probability (as EAGLE-2 expands its dynamic
trees), then one draft forward over the whole tree (tree attention, nothing committed) gives q
at the new nodes.

Why this stays exactly lossless when sampling: verification (specdec.verify.tree_rejection_sample)
assumes each node's children were drawn one after another without replacement from the node's
q. So the number of children a node gets is decided before they are drawn, from the node's own
score and the sorted values of its q (expected scores), never from the drawn children
themselves: keeping or dropping a child because of its value would bias it. When greedy, the
children are the top tokens of the draft's logits and any shape is fine.
"""

from __future__ import annotations

import heapq

import torch

from specdec.drafting.base import Draft, DraftRequest
from specdec.drafting.model import DraftModelDrafter, DraftModelState
from specdec.models.base import Attention, LanguageModel, tree_depths
from specdec.sampling import SamplingParams, logits_to_probs


def draft_distribution(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:  # [k, vocab] -> [k, vocab]
    """q when sampling; when greedy, the plain softmax (a measure of the draft's confidence)."""
    return logits.float().softmax(-1) if sampling.greedy else logits_to_probs(logits, sampling)


def allocate_children(frontier: list[tuple[int, float]], q_rows: dict[int, torch.Tensor], slots: int,
                      branching: int) -> dict[int, int]:
    """How many children each frontier node gets: the ``slots`` best (node, j) pairs by expected
    score, score(node) * (j-th largest q at node). Decided before any child is drawn."""
    candidates = []
    for node, score in frontier:
        q = q_rows[node]
        available = min(branching, int((q > 0).sum()))
        for j, value in enumerate(q.topk(available).values.tolist()):
            candidates.append((score * value, node, j))
    counts: dict[int, int] = {}
    for _, node, _ in heapq.nlargest(slots, candidates):
        counts[node] = counts.get(node, 0) + 1
    return counts


class ModelTreeDrafter(DraftModelDrafter):
    """A draft model proposing a tree of at most ``budget`` nodes, ``branching`` children per
    node at most, with the policy's gamma as its depth limit; each depth gets an equal share of
    the budget (at least one node), so trees are as deep as the policy asks, not wide and shallow."""

    def __init__(self, model: LanguageModel, budget: int = 16, branching: int = 4) -> None:
        if budget < 1 or branching < 1:
            raise ValueError(f"a tree needs budget >= 1 and branching >= 1, got {budget} and {branching}")
        super().__init__(model)  # observe(): the tree never enters the draft cache, only the emitted tokens do
        self.budget, self.branching = budget, branching

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        state: DraftModelState = request.draft_state
        context, sampling = request.context, request.sampling
        length = context.shape[0]
        budget = min(self.budget, self.model.max_context - length)
        if gamma <= 0 or budget <= 0:
            return Draft.empty(context.device)
        state.cache.reserve(length + budget)
        root_logits = state.feed_pending()  # [1, vocab]
        logits_rows = {-1: root_logits[0]}  # draft logits at the root and at each expanded node
        q_rows = {-1: draft_distribution(root_logits, sampling)[0]}
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        frontier = [(-1, 1.0)]
        per_depth = max(1, budget // gamma)
        for depth in range(gamma):
            counts = allocate_children(frontier, q_rows, min(per_depth, budget - len(tokens)), self.branching)
            new_nodes = []
            for node, score in frontier:
                count = counts.get(node, 0)
                if count == 0:
                    continue
                if sampling.greedy:
                    children = logits_rows[node].topk(count).indices
                else:
                    children = torch.multinomial(q_rows[node], count, replacement=False, generator=request.generator)
                for token in children.tolist():
                    tokens.append(token)
                    parents.append(node)
                    scores.append(score * float(q_rows[node][token]))
                    new_nodes.append(len(tokens) - 1)
            if depth == gamma - 1 or len(tokens) >= budget or not new_nodes:
                break
            # q at the new nodes: one draft forward over the tree so far, committed to nothing.
            positions = torch.tensor([length + d for d in tree_depths(parents)], device=context.device)
            block = torch.tensor(tokens, dtype=torch.long, device=context.device)
            logits = self.model.forward(block, positions, state.cache, Attention.tree(parents)).logits  # [n, vocab]
            fresh = logits[new_nodes]
            for node, row_logits, row_q in zip(new_nodes, fresh, draft_distribution(fresh, sampling)):
                logits_rows[node], q_rows[node] = row_logits, row_q
            frontier = [(node, scores[node]) for node in new_nodes]
        block = torch.tensor(tokens, dtype=torch.long, device=context.device)
        if sampling.greedy:
            return Draft(block, None, tuple(parents))
        # q per parent: row 0 at the root, row i + 1 at node i (zeros where a node has no children).
        probs = torch.zeros(len(tokens) + 1, q_rows[-1].shape[-1], dtype=q_rows[-1].dtype, device=context.device)
        for node, q in q_rows.items():
            probs[node + 1] = q
        return Draft(block, probs, tuple(parents))
