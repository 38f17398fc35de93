"""The numbers of one step's view, computed once for the terminal and the HTML report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdec.explain.record import ChainDecision, StepRecord, chain_decision


def token_text(tokenizer: Any, token: int) -> str:
    """A token as a person reads it: its text in quotes (escapes shown), or its id."""
    if tokenizer is None:
        return f"#{token}"
    return repr(tokenizer.decode([token]))


@dataclass(frozen=True)
class DraftRow:
    """One drafted token: q and p of it, and what verification did with it."""

    node: int  # index in the draft
    parent: int  # -1: hangs off the context (a chain's node i has parent i - 1)
    token: int
    q: float  # q(x) where it was drawn (1 for a guess with no q)
    p: float  # p(x) at the same place
    acceptance: float | None  # min(1, p/q) it was judged by (a tree's later siblings: against updated p, q)
    uniform: float | None  # the draw u (None: greedy, or not tried)
    # "accepted", "rejected", "not reached" (a chain); "on the path" / "off the path" (a tree); " (relaxed)"
    # after an accepted one that only a LOSSY acceptance rule kept
    decision: str
    from_cache: bool = False  # guessed from earlier requests' outputs (a suffix drafter's cache)

    def token_text(self, tokenizer: Any) -> str:
        return token_text(tokenizer, self.token) + (" (cache)" if self.from_cache else "")


@dataclass(frozen=True)
class TopToken:
    token: int
    probability: float


@dataclass(frozen=True)
class StepView:
    record: StepRecord
    decision: ChainDecision | None  # chains only
    rows: list[DraftRow]
    at: int  # the position (block row) where the target chose its own token
    q_top: list[TopToken]  # q there (empty: no q, or a bonus position)
    p_top: list[TopToken]  # p there
    final_top: list[TopToken]  # what the target's token was drawn from: the residual, or p


def top_tokens(dist: torch.Tensor, count: int) -> list[TopToken]:  # dist [vocab]
    values, tokens = torch.topk(dist.double(), min(count, dist.shape[-1]))
    return [TopToken(int(t), float(v)) for t, v in zip(tokens, values, strict=False) if v > 0]


def chain_rows(record: StepRecord, decision: ChainDecision) -> list[DraftRow]:
    q = record.draft_probs()
    rows = []
    for i, token in enumerate(record.draft_tokens):
        state = "accepted" if i < decision.num_accepted else "rejected" if i == decision.num_accepted else "not reached"
        state += " (relaxed)" if i in record.relaxed else ""  # kept by a LOSSY rule only
        reached = i <= decision.num_accepted
        rows.append(DraftRow(i, i - 1, token, float(q[i, token]), float(record.p[i, token]),
                             decision.acceptance[i] if reached and not record.greedy else None,
                             decision.uniforms[i] if reached and decision.uniforms else None, state,
                             bool(record.from_cache and record.from_cache[i])))
    return rows


def tried_nodes(parents: tuple[int, ...], path: list[int], relaxed: list[int]) -> list[int]:
    """The tree nodes verification judged: at the root and at each accepted node, its children in
    the order drawn, up to the one accepted (all of them where the path ends, or where a LOSSY
    rule kept one after the exact test turned them all down)."""
    tried = []
    for node, accepted in zip([-1, *path], [*path, None], strict=False):
        children = [child for child, parent in enumerate(parents) if parent == node]
        if accepted is None or accepted in relaxed:
            tried += children
        else:
            tried += children[: children.index(accepted) + 1]
    return tried


def tree_rows(record: StepRecord) -> list[DraftRow]:
    assert record.parents is not None  # a tree step
    path, decision = record.path or [], record.decision
    tried = tried_nodes(record.parents, path, record.relaxed)
    rows = []
    acceptance: float | None
    for node, (token, parent) in enumerate(zip(record.draft_tokens, record.parents, strict=False)):
        q = 1.0 if record.q is None else float(record.q[parent + 1, token])
        p = float(record.p[parent + 1, token])
        if decision is not None and node in tried:  # the sampler's own test (later siblings: updated p, q)
            acceptance, uniform = float(decision.acceptance[node]), float(decision.uniforms[node])
        else:  # greedy, or not tried: as a first sibling would be judged
            first_sibling = record.parents.index(parent) == node
            acceptance, uniform = (min(1.0, p / q) if first_sibling and q > 0 else None), None
        rows.append(DraftRow(node, parent, token, q, p, acceptance, uniform,
                             ("on the path" + (" (relaxed)" if node in record.relaxed else "")) if node in path
                             else "off the path",
                             bool(record.from_cache and record.from_cache[node])))
    return rows


def step_view(record: StepRecord, top: int = 6) -> StepView:
    if record.parents is None:
        decision = chain_decision(record)
        rows, at = chain_rows(record, decision), decision.num_accepted
        final = decision.final_dist
    else:
        decision, rows = None, tree_rows(record)
        at = record.path[-1] + 1 if record.path else 0
        # after the siblings' rejections the tree draws from an updated p: the sampler's
        final = record.p[at] if record.decision is None else record.decision.final_dist
    q = record.draft_probs() if record.parents is None else record.q
    q_top = top_tokens(q[at], top) if q is not None and at < q.shape[0] else []
    return StepView(record, decision, rows, at, q_top, top_tokens(record.p[at], top), top_tokens(final, top))
