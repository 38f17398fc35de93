"""Verification of a whole engine step in one pass over the flattened ragged batch (vLLM's shape:
every request's drafted nodes in one tensor, with cumulative counts), instead of a call per
request: one host sync for any batch size.

- Walks (``greedy_verify_ragged``): greedy requests, exact or under a lossy acceptance rule, and
  the coupled rule (its draws keyed by position), chains and trees: the batch's tokens and the
  tokens to follow go to the host once, and each request's path is walked there by the one greedy
  walk (specdec.core.verify.greedy_walk).
- Rejection sampling, chains and trees (specdec.core.verify.rejection_sample_ragged, the one rejection
  sampler): the first acceptance tests and the residual distributions of every request at once;
  the random numbers come from each request's own generator, so a request's samples are what it
  gets alone, whatever its neighbours. Lossy acceptance rules (specdec.core.acceptance) join it too.

``verify_step`` sorts an engine step's requests into those passes (specdec.core.rules: ``ragged`` says
which rule's drafts join the rejection pass). ``verify_request`` gives one request's verdict by
itself, through its rule: the reference the batched passes are tested against. Verification reads
a narrow view of a request (``RequestView``), not the engine's Request.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from specdec.core.acceptance import Relaxation, parse_acceptance, relaxation_for
from specdec.core.drafts import Draft, block_depths
from specdec.core.rules import SamplingRule
from specdec.core.sampling import SamplingParams, logits_to_probs
from specdec.core.verify import (
    RaggedDrafts,
    RejectionDecision,
    greedy_tree_verify_tokens,
    greedy_verify_tokens,
    greedy_walk,
    rejection_sample_ragged,
    tree_rejection_sample,
)


class RequestView(Protocol):
    """What verification reads of a request (the engine's Request is one)."""

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def rule(self) -> SamplingRule: ...  # how it verifies when sampling (specdec.core.rules)

    @property
    def length(self) -> int: ...  # tokens in its context: the output position of the first drafted token

    @property
    def generator(self) -> torch.Generator: ...  # its own random numbers (rejection sampling)


class Verdict(NamedTuple):
    """One request's verification."""

    emitted: torch.Tensor  # [m + 1] int64: the accepted drafts, then the target's token
    path: torch.Tensor | None  # [m]: a tree's accepted nodes (None: a chain)
    relaxed: tuple[int, ...] = ()  # accepted draft nodes that only a lossy acceptance rule accepted
    decision: RejectionDecision | None = None  # the sampler's tests, when verify_step was asked to keep them


def greedy_verify_ragged(
    draft_tokens: Sequence[torch.Tensor],  # [nodes_r] int64 per request
    parents: Sequence[Sequence[int] | None],  # each request's tree parents (-1: the root); None for a chain
    target_tokens: torch.Tensor,  # [rows] int64: the target's token at each row of the step (argmax, or a draw)
    offsets: Sequence[int],  # [batch + 1]: request r's block is rows offsets[r] .. offsets[r] + nodes_r + 1
    relaxations: Sequence[Relaxation | None] | None = None,  # per request: LOSSY acceptance; None: exact
) -> list[tuple[torch.Tensor, list[int]]]:  # per request: emitted [m + 1], accepted path [m] (node indices)
    """Every request's greedy walk (specdec.core.verify.greedy_walk, the one for chains and trees): one
    transfer of the batch's tokens to the host, a walk over them each, then one tensor of every
    emitted token. (Measured on 2 CPU cores, tensor operations for the walk cost more than it: a
    few dozen small ops against a few hundred integer comparisons; the host sync is the one any
    step makes.)"""
    device = target_tokens.device
    counts = [piece.shape[0] for piece in draft_tokens]
    flat_drafts = torch.cat(list(draft_tokens)).tolist() if draft_tokens else []
    best = target_tokens.tolist()
    relaxations = relaxations or [None] * len(counts)
    paths, emitted, start = [], [], 0
    for count, tree, first_row, relaxation in zip(counts, parents, offsets, relaxations, strict=False):
        tokens_out, path = greedy_walk(flat_drafts[start : start + count], tree,
                                       best[first_row : first_row + count + 1], relaxation)
        paths.append(path)
        emitted.append(tokens_out)
        start += count
    flat = torch.tensor([token for tokens_out in emitted for token in tokens_out], dtype=torch.long, device=device)
    return list(zip(flat.split([len(tokens_out) for tokens_out in emitted]), paths, strict=False))


def node_draft_probs(draft: Draft) -> torch.Tensor | None:  # [nodes, vocab]
    """q each drafted node was drawn from (a tree's rows are per parent), or None: guesses."""
    if draft.probs is None:
        return None
    return draft.probs[: draft.num_nodes] if draft.parents is None else draft.probs[[p + 1 for p in draft.parents]]


def verify_request(
    request: RequestView,
    draft: Draft,
    target_logits: torch.Tensor,  # [gamma + 1, vocab]: after the last context token, after each draft node
    target_argmax: torch.Tensor | None,  # [gamma + 1], when greedy
) -> Verdict:
    """One request's verdict, by its sampling rule and acceptance (specdec.core.acceptance)."""
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
        elif request.rule.ragged:  # rejection sampling: q at each node's parent
            emitted, path = tree_rejection_sample(draft.tokens, draft.parents, draft.probs, target_probs,
                                                  request.generator, False, relaxation)
        else:  # a node is accepted where it is the rule's draw at its position, given its path
            positions = [request.length + depth for depth in block_depths(draft)]
            emitted, path = greedy_tree_verify_tokens(draft.tokens, draft.parents,
                                                      request.rule.draw(target_probs, positions), relaxation)
    return Verdict(emitted, path, () if relaxation is None else tuple(relaxation.used))


def verify_step(
    requests: Sequence[RequestView],
    drafts: Sequence[Draft],
    logits: torch.Tensor,  # [rows, vocab]: the step's target logits, every request's block
    argmax: torch.Tensor | None,  # [rows], taken when any request is greedy
    offsets: Sequence[int],  # [batch + 1]: request r's block is rows offsets[r] .. offsets[r + 1]
    keep_decisions: bool = False,  # sampled verdicts keep the sampler's RejectionDecision (explain shows them)
) -> list[Verdict]:
    """Each request's verdict, in two passes over the batch: one greedy walk for every request
    whose verdict is a walk (greedy, exact or lossy, chains and trees; the coupled rule, which
    walks its position-keyed draws), and rejection sampling in one pass per sampling setting (the
    target's probabilities computed for all their rows at once). verify_request is the same
    verdict request by request (the reference the tests hold this to)."""
    verdicts: list[Verdict | None] = [None] * len(requests)
    device = logits.device

    def rows_of(indices: list[int]) -> torch.Tensor:  # [rows of those requests' blocks]
        return torch.cat([torch.arange(offsets[i], offsets[i + 1], device=device) for i in indices])

    acceptances = [parse_acceptance(request.sampling.acceptance) for request in requests]
    walking = [i for i, request in enumerate(requests) if request.sampling.greedy or not request.rule.ragged]
    if walking:
        best, relaxations = [], []  # [request]: its rows' tokens to follow, its relaxation
        for i in walking:
            request, draft, rows = requests[i], drafts[i], slice(offsets[i], offsets[i + 1])
            if request.sampling.greedy:
                assert argmax is not None  # taken whenever a request is greedy
                best.append(argmax[rows])
                # greedy p is a point mass: the relaxed set reads the target's softmax at temperature 1
                probs = None if acceptances[i].exact else logits[rows].float().softmax(-1)
            else:
                probs = logits_to_probs(logits[rows], request.sampling)  # [block, vocab]
                best.append(request.rule.draw(probs, [request.length + depth for depth in block_depths(draft)]))
            relaxations.append(None if probs is None else relaxation_for(acceptances[i], probs, draft.tokens,
                                                                         draft.parents))
        starts = [0, *itertools.accumulate(drafts[i].num_nodes + 1 for i in walking)]
        walked = greedy_verify_ragged([drafts[i].tokens for i in walking], [drafts[i].parents for i in walking],
                                      torch.cat(best), starts[:-1], relaxations)
        for i, (emitted, path), relaxation in zip(walking, walked, relaxations, strict=True):
            verdicts[i] = Verdict(emitted, None if drafts[i].parents is None else torch.tensor(path, dtype=torch.long),
                                  () if relaxation is None else tuple(relaxation.used))
    groups: dict[tuple, list[int]] = {}
    for i, (request, draft) in enumerate(zip(requests, drafts, strict=False)):
        if verdicts[i] is None:  # sampled under a rule whose drafts join the ragged pass (rejection)
            sampling = request.sampling
            # q's precision is the arithmetic's; point masses take p's (float32, logits_to_probs).
            precision = torch.float32 if draft.probs is None else draft.probs.dtype
            key = (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, precision)
            groups.setdefault(key, []).append(i)
    for group in groups.values():
        target_probs = logits_to_probs(logits[rows_of(group)], requests[group[0]].sampling)  # [rows, vocab]
        starts = [0, *itertools.accumulate(drafts[i].num_nodes + 1 for i in group)]  # each block's rows
        relaxations = [relaxation_for(acceptances[i], target_probs[start:end], drafts[i].tokens, drafts[i].parents)
                       for i, start, end in zip(group, starts, starts[1:], strict=False)]
        decisions: list[RejectionDecision] | None = [] if keep_decisions else None
        results = rejection_sample_ragged(RaggedDrafts.of([drafts[i].tokens for i in group],
                                                          [drafts[i].parents for i in group], device),
                                          [node_draft_probs(drafts[i]) for i in group], target_probs,
                                          [requests[i].generator for i in group], relaxations, decisions)
        for k, (i, (emitted, path), relaxation) in enumerate(zip(group, results, relaxations, strict=False)):
            verdicts[i] = Verdict(emitted, None if drafts[i].parents is None else torch.tensor(path, dtype=torch.long),
                                  () if relaxation is None else tuple(relaxation.used),
                                  None if decisions is None else decisions[k])
    return [verdict for verdict in verdicts if verdict is not None]
