"""Token trees from a draft model: several continuations verified in one target forward.

The tree grows depth by depth under a node budget. At each depth the budget goes to the
children with the highest expected cumulative draft probability (as EAGLE-2 expands its dynamic
trees), then one draft forward of the new nodes (tree attention over the nodes written by the
earlier depths, nothing committed) gives q at them.

Why this stays exactly lossless when sampling: verification (specdec.core.verify.tree_rejection_sample)
assumes each node's children were drawn one after another without replacement from the node's
q. So the number of children a node gets is decided before they are drawn, from the node's own
score and the sorted values of its q (expected scores), never from the drawn children
themselves: keeping or dropping a child because of its value would bias it. When greedy, the
children are the top tokens of the draft's logits and any shape is fine.
"""

from __future__ import annotations

import heapq

import torch

from specdec.core.drafts import Draft, DraftRequest
from specdec.core.sampling import SamplingParams, logits_to_probs
from specdec.drafting.lockstep import DraftSteps, relay
from specdec.drafting.model import DraftModelDrafter, DraftModelState, LogitColumns, RowBlock
from specdec.models.base import LanguageModel, tree_depths


def draft_distribution(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:  # [k, vocab] -> [k, vocab]
    """q when sampling; when greedy, the plain softmax (a measure of the draft's confidence)."""
    return logits.float().softmax(-1) if sampling.greedy else logits_to_probs(logits, sampling)


def allocate_children(scores: list[float], top_q: list[list[float]], slots: int) -> list[int]:
    """How many children each frontier node gets: the ``slots`` best (node, j) pairs by expected
    score, scores[node] * top_q[node][j] (the j-th largest q at the node). Decided before any
    child is drawn. top_q: [frontier, branching], descending."""
    candidates = [(score * value, node, j) for node, (score, values) in enumerate(zip(scores, top_q, strict=True))
                  for j, value in enumerate(values) if value > 0]
    counts = [0] * len(scores)
    for _, node, _ in heapq.nlargest(slots, candidates):
        counts[node] += 1
    return counts


#: What tree_steps asks scored: (tokens, parents of every node so far, the new nodes' indices).
NewNodes = tuple[list[int], list[int], list[int]]


def tree_steps(
    root_q: torch.Tensor,  # [1, vocab] (or [1, columns]): draft_distribution at the root
    depth_limit: int,
    budget: int,
    branching: int,
    request: DraftRequest,
    columns: LogitColumns | None = None,  # what q is over, where a draft vocabulary (greedy only)
) -> DraftSteps[NewNodes]:  # yields each depth's NewNodes, is sent q at them [new, vocab] (or [new, columns])
    """A tree of at most ``budget`` nodes and ``depth_limit`` depths, ``branching`` children per
    node at most; each depth gets an equal share of the budget (at least one node), so trees
    are as deep as the policy asks, not wide and shallow. One question per depth; a generator
    (drafting/lockstep.py), so that a batch of requests can draft in lockstep. A greedy tree may
    score over a draft vocabulary's columns (its top children are the same tokens); a sampled
    one's q is over the whole vocabulary, as verification reads it."""
    device, sampling = root_q.device, request.sampling
    if columns is not None and not sampling.greedy:
        raise ValueError("a sampled tree's q is over the target's whole vocabulary (widen it first)")
    first_position = request.context.shape[0]  # the output position of the root's children
    frontier = [-1]  # nodes whose children are drawn next (-1 = the root)
    frontier_q = root_q  # [frontier, vocab]
    frontier_scores = [1.0]
    q_rows = {}  # q at every node that gets children (sampling)
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    per_depth = max(1, budget // depth_limit)
    for depth in range(depth_limit):
        top = frontier_q.topk(min(branching, frontier_q.shape[-1]), dim=-1)  # [frontier, branching]
        counts = allocate_children(frontier_scores, top.values.tolist(), min(per_depth, budget - len(tokens)))
        new_nodes = []
        for row, (node, count) in enumerate(zip(frontier, counts, strict=True)):
            if count == 0:
                continue
            if sampling.greedy:  # the top tokens (any tree is exact when greedy)
                children, child_q = top.indices[row, :count], top.values[row, :count]
                if columns is not None:
                    children = columns.token_ids[children]
            else:  # drawn one after another without replacement, as verification assumes
                q_rows[node] = frontier_q[row]
                children = request.rule.draw_distinct(frontier_q[row], first_position + depth, count)
                child_q = frontier_q[row, children]
            for token, probability in zip(children.tolist(), child_q.tolist(), strict=True):
                tokens.append(token)
                parents.append(node)
                scores.append(frontier_scores[row] * probability)
                new_nodes.append(len(tokens) - 1)
        if depth == depth_limit - 1 or len(tokens) >= budget or not new_nodes:
            break
        frontier_q = yield tokens, parents, new_nodes
        frontier, frontier_scores = new_nodes, [scores[node] for node in new_nodes]
    block = torch.tensor(tokens, dtype=torch.long, device=device)
    if sampling.greedy:
        return Draft(block, None, tuple(parents))
    # q per parent: row 0 at the root, row i + 1 at node i (zeros where a node has no children).
    probs = torch.zeros(len(tokens) + 1, root_q.shape[-1], dtype=frontier_q.dtype, device=device)
    for node, q in q_rows.items():
        probs[node + 1] = q
    return Draft(block, probs, tuple(parents))


def check_tree_shape(budget: int, branching: int) -> None:
    if budget < 1 or branching < 1:
        raise ValueError(f"a tree needs budget >= 1 and branching >= 1, got {budget} and {branching}")


class ModelTreeDrafter(DraftModelDrafter):
    """A draft model proposing a tree (tree_steps) of at most ``budget`` nodes, ``branching``
    children per node at most, with the policy's gamma as its depth limit."""

    def __init__(self, model: LanguageModel, budget: int = 16, branching: int = 4) -> None:
        check_tree_shape(budget, branching)
        super().__init__(model)  # observe(): the tree never enters the draft cache, only the emitted tokens do
        self.budget, self.branching = budget, branching

    def describe(self) -> str:
        return f"draft-model tree ({self.model.name}, up to {self.budget} nodes, {self.branching} children each)"

    def routine(self, request: DraftRequest, gamma: int) -> DraftSteps[RowBlock] | None:
        state: DraftModelState = request.draft_state
        length = request.context.shape[0]
        budget = min(request.node_budget or self.budget, self.model.max_context - length)
        if gamma <= 0 or budget <= 0:
            return None
        state.cache.reserve(length + budget)
        return model_tree_steps(state, gamma, budget, self.branching, request)


def model_tree_steps(state: DraftModelState, depth_limit: int, budget: int, branching: int,
                     request: DraftRequest) -> DraftSteps[RowBlock]:
    """tree_steps with its draft forwards in the state's row: first the context the row lacks (q
    at the root), then each depth's new nodes, which attend to the nodes earlier forwards wrote
    (nothing is committed: the tree stays past the context)."""
    sampling, length = request.sampling, request.context.shape[0]
    root_logits = yield RowBlock.chain(state, state.take_pending())

    def nodes_block(nodes: NewNodes) -> RowBlock:
        tokens, parents, new_nodes = nodes
        written, depths = new_nodes[0], tree_depths(parents)
        block = torch.tensor(tokens[written:], dtype=torch.long, device=root_logits.device)
        positions = torch.tensor([length + depths[node] for node in new_nodes], device=block.device)
        return RowBlock(state, block, positions, tuple(parents), written)

    steps = tree_steps(draft_distribution(root_logits[-1:], sampling), depth_limit, budget, branching, request)
    return (yield from relay(steps, nodes_block, lambda logits: draft_distribution(logits, sampling)))
