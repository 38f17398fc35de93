"""Verification of a whole engine step in one pass over the flattened ragged batch (vLLM's shape:
every request's drafted nodes in one tensor, with cumulative counts), instead of a call per
request: one host sync for any batch size.

- Greedy, chains and trees (``greedy_verify_ragged``): the batch's tokens and the target's argmax
  go to the host once, and each request's path is walked there. It emits what
  greedy_tree_verify_tokens emits request by request.
- Rejection sampling of chains (``rejection_sample_ragged``): the acceptance tests and the
  residual distributions of every request at once; the random numbers come from each request's
  own generator, drawn in the order rejection_sample draws them (its uniforms, then its final
  token), so a request's samples are what it gets alone, whatever its neighbours.

``verify_step`` sorts an engine step's requests into those passes. Trees under rejection sampling
(recursive, sibling by sibling) and the coupled rule (noise keyed by position) stay with each
request's rule (specdec.rules: ``ragged_chains`` says which rule's chains join the pass). So do the
requests that asked for LOSSY acceptance (specdec.acceptance): verify_request applies its rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from specdec.acceptance import parse_acceptance, relaxation_for
from specdec.sampling import logits_to_probs
from specdec.drafting.base import block_depths
from specdec.verify import (greedy_tree_verify_tokens, greedy_verify_tokens, point_mass_probs,
                            residual_distribution)

if TYPE_CHECKING:
    from specdec.drafting.base import Draft
    from specdec.engine import Request


class Verdict(NamedTuple):
    """One request's verification."""

    emitted: torch.Tensor  # [m + 1] int64: the accepted drafts, then the target's token
    path: torch.Tensor | None  # [m]: a tree's accepted nodes (None: a chain)
    relaxed: tuple[int, ...] = ()  # accepted draft nodes that only a lossy acceptance rule accepted


@dataclass(frozen=True)
class RaggedDrafts:
    """Drafts of several requests, flattened. Request r owns nodes cu_nodes[r] .. cu_nodes[r + 1]
    and rows cu_nodes[r] + r .. cu_nodes[r + 1] + r of the target's output (its block: the last
    context token, then its nodes)."""

    tokens: torch.Tensor  # [nodes] int64
    parents: torch.Tensor  # [nodes] int64: the parent's index within its request, -1 for the root
    cu_nodes: torch.Tensor  # [batch + 1] int64, cumulative node counts

    @staticmethod
    def of(tokens: Sequence[torch.Tensor],  # [nodes_r] int64 each
           parents: Sequence[Sequence[int] | None],  # each request's tree parents; None for a chain
           device: torch.device | str = "cpu") -> RaggedDrafts:
        counts = [piece.shape[0] for piece in tokens]
        flat_parents = [parent for count, tree in zip(counts, parents, strict=True)
                        for parent in (range(-1, count - 1) if tree is None else tree)]
        cu_nodes = torch.tensor([0, *counts], device=device).cumsum(0)
        flat = torch.cat(list(tokens)).to(device) if tokens else torch.zeros(0, dtype=torch.long, device=device)
        return RaggedDrafts(flat.long(), torch.tensor(flat_parents, dtype=torch.long, device=device), cu_nodes)

    @property
    def batch(self) -> int:
        return self.cu_nodes.shape[0] - 1

    def layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per node: its request [nodes], its index within the request [nodes], and per request
        the row of its block's first token in the target's output [batch]."""
        counts = self.cu_nodes[1:] - self.cu_nodes[:-1]
        request = torch.repeat_interleave(torch.arange(self.batch, device=counts.device), counts)
        local = torch.arange(self.tokens.shape[0], device=counts.device) - self.cu_nodes[:-1][request]
        return request, local, self.cu_nodes[:-1] + torch.arange(self.batch, device=counts.device)


def greedy_verify_ragged(
    draft_tokens: Sequence[torch.Tensor],  # [nodes_r] int64 per request
    parents: Sequence[Sequence[int] | None],  # each request's tree parents (-1: the root); None for a chain
    target_tokens: torch.Tensor,  # [rows] int64: the target's argmax at each row of the step
    offsets: Sequence[int],  # [batch + 1]: request r's block is rows offsets[r] .. offsets[r] + nodes_r + 1
) -> list[tuple[torch.Tensor, list[int]]]:  # per request: emitted [m + 1], accepted path [m] (node indices)
    """Every request's longest drafted path that the target's argmax follows (the first matching
    child at each node, as greedy_tree_verify_tokens), then the target's next token: one transfer
    of the batch's tokens to the host and a walk over them, then one tensor of every emitted token.
    (Measured on 2 CPU cores, tensor operations for the walk cost more than it: a few dozen small
    ops against a few hundred integer comparisons; the host sync is the one any step makes.)"""
    device = target_tokens.device
    counts = [piece.shape[0] for piece in draft_tokens]
    flat_drafts = torch.cat(list(draft_tokens)).tolist() if draft_tokens else []
    best = target_tokens.tolist()
    paths, emitted, start = [], [], 0
    for count, tree, first_row in zip(counts, parents, offsets, strict=False):
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(range(-1, count - 1) if tree is None else tree):
            children.setdefault(parent, []).append(node)
        node, path = -1, []
        while (match := next((child for child in children.get(node, ())
                              if flat_drafts[start + child] == best[first_row + node + 1]), None)) is not None:
            path.append(match)
            node = match
        paths.append(path)
        emitted.append([flat_drafts[start + node] for node in path] + [best[first_row + node + 1]])
        start += count
    flat = torch.tensor([token for tokens_out in emitted for token in tokens_out], dtype=torch.long, device=device)
    return list(zip(flat.split([len(tokens_out) for tokens_out in emitted]), paths, strict=True))


def rejection_sample_ragged(
    drafts: RaggedDrafts,  # chains only
    draft_probs: torch.Tensor,  # [nodes, vocab]: q each token was drawn from (point masses for deterministic drafts)
    target_probs: torch.Tensor,  # [nodes + batch, vocab]
    generators: Sequence[torch.Generator | None],  # [batch]: each request's own
) -> list[torch.Tensor]:  # per request: emitted [n_accepted + 1] int64
    """rejection_sample (Leviathan et al. 2023) for every request's chain at once: accept drafted
    x with probability min(1, p(x) / q(x)) until the first rejection, then a token from
    norm(max(0, p - q)) there, or from p after the last draft when all are accepted."""
    request, local, block_start = drafts.layout()
    nodes, counts = drafts.tokens.shape[0], (drafts.cu_nodes[1:] - drafts.cu_nodes[:-1]).tolist()
    target_probs = target_probs.to(draft_probs.dtype)
    index = drafts.tokens[:, None]
    p_x = target_probs[block_start[request] + local].gather(-1, index)[:, 0]  # [nodes]: row i predicts node i
    q_x = draft_probs.gather(-1, index)[:, 0]
    acceptance = torch.clamp(p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny), max=1.0)
    uniforms = torch.cat([torch.rand(count, generator=generator, device=draft_probs.device, dtype=draft_probs.dtype)
                          for count, generator in zip(counts, generators, strict=True)]) if nodes else acceptance
    rejected = torch.where(uniforms < acceptance, drafts.cu_nodes[1:][request] - drafts.cu_nodes[:-1][request], local)
    num_accepted = (drafts.cu_nodes[1:] - drafts.cu_nodes[:-1]).scatter_reduce(0, request, rejected, "amin")  # [batch]
    all_accepted = num_accepted == drafts.cu_nodes[1:] - drafts.cu_nodes[:-1]
    # q at the first rejected position, zeros after a fully accepted chain (so the residual is p).
    q_rows = draft_probs[(drafts.cu_nodes[:-1] + num_accepted).clamp_max(max(0, nodes - 1))] if nodes else \
        torch.zeros(drafts.batch, target_probs.shape[1], dtype=draft_probs.dtype, device=draft_probs.device)
    p_rows = target_probs[block_start + num_accepted]
    final = torch.where(all_accepted[:, None], p_rows, residual_distribution(q_rows, p_rows))  # [batch, vocab]
    results = []
    for row, (accepted, start, generator) in enumerate(zip(num_accepted.tolist(), drafts.cu_nodes.tolist(),
                                                            generators, strict=False)):
        final_token = torch.multinomial(final[row], 1, generator=generator)
        results.append(torch.cat([drafts.tokens[start : start + accepted], final_token]))
    return results


def draft_probs_of(draft: Draft, target_probs: torch.Tensor) -> torch.Tensor:  # [nodes, vocab]
    """q of a chain's tokens: its own, or point masses (a deterministic drafter) in p's precision."""
    if draft.probs is None:
        return point_mass_probs(draft.tokens, target_probs.shape[1]).to(target_probs.dtype)
    return draft.probs[: draft.num_nodes]


def verify_request(
    request: Request,
    draft: Draft,
    target_logits: torch.Tensor,  # [gamma + 1, vocab]: after the last context token, after each draft node
    target_argmax: torch.Tensor | None,  # [gamma + 1], when greedy
) -> Verdict:
    """One request's verdict, by its sampling rule and acceptance (specdec.acceptance)."""
    acceptance = parse_acceptance(request.sampling.acceptance)
    if request.sampling.greedy:
        assert target_argmax is not None  # the engine takes it whenever a request is greedy
        # greedy p is a point mass: the relaxed set reads the target's softmax at temperature 1
        relaxation = None if acceptance.exact else relaxation_for(acceptance, target_logits.float().softmax(-1),
                                                                  draft.tokens, draft.parents)
        if draft.parents is None:
            emitted, path = greedy_verify_tokens(draft.tokens, target_argmax, relaxation), None
        else:
            emitted, path = greedy_tree_verify_tokens(draft.tokens, draft.parents, target_argmax, relaxation)
    else:
        target_probs = logits_to_probs(target_logits, request.sampling)  # [gamma + 1, vocab]
        relaxation = relaxation_for(acceptance, target_probs, draft.tokens, draft.parents)
        if draft.parents is None:  # row i of target_probs draws output position length + i
            emitted = request.rule.verify_chain(draft.tokens, draft.probs, target_probs, request.length, relaxation)
            path = None
        else:
            positions = [request.length + depth for depth in block_depths(draft)]
            emitted, path = request.rule.verify_tree(draft.tokens, draft.parents, draft.probs, target_probs, positions,
                                                     relaxation)
    return Verdict(emitted, path, () if relaxation is None else tuple(relaxation.used))


def verify_step(
    requests: Sequence[Request],
    drafts: Sequence[Draft],
    logits: torch.Tensor,  # [rows, vocab]: the step's target logits, every request's block
    argmax: torch.Tensor | None,  # [rows], taken when any request is greedy
    offsets: Sequence[int],  # [batch + 1]: request r's block is rows offsets[r] .. offsets[r + 1]
    verify_one: Callable[[Request, Draft, torch.Tensor, torch.Tensor | None], Verdict] = verify_request,
    one_pass: bool = True,
) -> list[Verdict]:
    """Each request's verdict: greedy requests (chains and trees) in one pass, sampled chains of a
    rule that allows it in one pass per sampling setting (the target's probabilities are computed
    for all their rows at once), the rest (lossy acceptance among them) by ``verify_one``, request
    by request (all of them without ``one_pass``)."""
    verdicts: list[Verdict | None] = [None] * len(requests)
    device = logits.device

    def rows_of(indices: list[int]) -> torch.Tensor:  # [rows of those requests' blocks]
        return torch.cat([torch.arange(offsets[i], offsets[i + 1], device=device) for i in indices])

    # which requests may join a pass: all with one_pass, but those with a lossy acceptance rule
    joins = [one_pass and parse_acceptance(request.sampling.acceptance).exact for request in requests]
    greedy = [i for i, request in enumerate(requests) if request.sampling.greedy and joins[i]]
    if greedy:
        assert argmax is not None  # taken whenever a request is greedy
        for i, (emitted, path) in zip(greedy, greedy_verify_ragged([drafts[i].tokens for i in greedy],
                                                                   [drafts[i].parents for i in greedy], argmax,
                                                                   [offsets[i] for i in greedy]), strict=True):
            verdicts[i] = Verdict(emitted, None if drafts[i].parents is None else torch.tensor(path, dtype=torch.long))
    groups: dict[tuple, list[int]] = {}
    for i, (request, draft) in enumerate(zip(requests, drafts, strict=True)):
        if joins[i] and not request.sampling.greedy and request.rule.ragged_chains and draft.parents is None:
            sampling = request.sampling
            # q's precision is the arithmetic's (rejection_sample's); point masses take p's (float32).
            precision = torch.float32 if draft.probs is None else draft.probs.dtype
            key = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, precision)
            groups.setdefault(key, []).append(i)
    for group in groups.values():
        if len(group) == 1:  # alone, the per-request path is the same verdict with fewer operations
            continue
        target_probs = logits_to_probs(logits[rows_of(group)], requests[group[0]].sampling)  # [rows, vocab]
        draft_probs = torch.cat([draft_probs_of(drafts[i], target_probs) for i in group])
        ragged = RaggedDrafts.of([drafts[i].tokens for i in group], [None] * len(group), device)
        for i, emitted in zip(group, rejection_sample_ragged(ragged, draft_probs, target_probs,
                                                             [requests[i].generator for i in group]), strict=True):
            verdicts[i] = Verdict(emitted, None)
    for i, (request, draft) in enumerate(zip(requests, drafts, strict=True)):
        if verdicts[i] is None:
            start, end = offsets[i], offsets[i + 1]
            verdicts[i] = verify_one(request, draft, logits[start:end], None if argmax is None else argmax[start:end])
    return [verdict for verdict in verdicts if verdict is not None]
