"""Verification of drafted chains and trees: pure functions on tensors, no models, no caches.

Notation (Leviathan et al. 2023, Algorithm 1): p = target, q = draft. The target scored a chain
of ``gamma`` tokens, or a tree of nodes, in one forward: one distribution after the last context
token and one after each node. Every verifier returns the accepted drafts, then exactly one token
chosen by the target (its correction where a draft was rejected, or the bonus token). Greedy
verification follows the target's argmax; rejection sampling is one function,
``rejection_sample_ragged`` (chains and trees of a batch; ``rejection_sample`` and
``tree_rejection_sample`` are a batch of one). An optional ``relaxation`` (specdec.core.acceptance,
LOSSY and opt-in) keeps a draft the exact test turned down when its relaxed set admits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.core.acceptance import Relaxation


def greedy_verify(
    draft_tokens: torch.Tensor,  # [gamma] int64
    target_logits: torch.Tensor,  # [gamma + 1, vocab]
) -> torch.Tensor:  # [n_accepted + 1] int64
    """Longest prefix of the draft that equals the target's argmax, then the target's token."""
    return greedy_verify_tokens(draft_tokens, target_logits.argmax(-1))


def greedy_verify_tokens(
    draft_tokens: torch.Tensor,  # [gamma] int64
    target_tokens: torch.Tensor,  # [gamma + 1] int64, the target's argmax at each position
    relaxation: Relaxation | None = None,
) -> torch.Tensor:  # [n_accepted + 1] int64
    """greedy_verify with the argmax already taken (an engine takes it once for a whole batch)."""
    emitted, _ = greedy_walk(draft_tokens.tolist(), None, target_tokens.tolist(), relaxation)
    return torch.tensor(emitted, dtype=torch.long, device=target_tokens.device)


def greedy_walk(
    tokens: Sequence[int],  # [n]: the drafted nodes
    parents: Sequence[int] | None,  # [n]: each node's parent (-1: the root); None: a chain
    best: Sequence[int],  # [n + 1]: the target's token at the root and after each node (its argmax, or a draw)
    relaxation: Relaxation | None = None,  # LOSSY acceptance (specdec.core.acceptance); None: exact
) -> tuple[list[int], list[int]]:  # emitted [m + 1], accepted path [m] (node indices)
    """The one greedy walk, for chains and trees alike: down the draft from the root, at each node
    the first child whose token is the target's there (else, under a relaxation, the child it
    admits), then the target's token after the last node reached. A chain is the tree whose
    node i's parent is i - 1. The coupled rule walks its draws the same way."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(range(-1, len(tokens) - 1) if parents is None else parents):
        children.setdefault(int(parent), []).append(node)
    node, path = -1, list[int]()
    while True:
        options = children.get(node, [])
        match = next((child for child in options if tokens[child] == best[node + 1]), None)
        if match is None and relaxation is not None and options:  # a kept draft emits its own token
            match = relaxation.fallback(options)
        if match is None:
            return [tokens[child] for child in path] + [best[node + 1]], path
        path.append(match)
        node = match


def acceptance_probs(
    draft_tokens: torch.Tensor,  # [gamma] int64
    draft_probs: torch.Tensor,  # [gamma, vocab]
    target_probs: torch.Tensor,  # [gamma + 1, vocab] (only the first gamma rows are read)
) -> torch.Tensor:  # [gamma] float, min(1, p(x) / q(x)) for each drafted x
    index = draft_tokens.unsqueeze(-1)
    return judge(target_probs[: draft_tokens.shape[0]].gather(-1, index)[:, 0], draft_probs.gather(-1, index)[:, 0])


def judge(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:  # [n] each -> [n]: min(1, p(x) / q(x))
    # q_x > 0 for any token actually drawn from q; the clamp only guards the division.
    return torch.clamp(p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny), max=1.0)


def residual_distribution(
    draft_probs: torch.Tensor,  # [gamma, vocab]
    target_probs: torch.Tensor,  # [gamma, vocab]
) -> torch.Tensor:  # [gamma, vocab], norm(max(0, p - q)) per row
    """Where to resample after a rejection. A row with no positive mass (p == q there, where a
    rejection has probability zero) falls back to p so the result is always a distribution."""
    residual = (target_probs - draft_probs).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), target_probs)


def point_mass_probs(
    draft_tokens: torch.Tensor,  # [gamma] int64
    vocab_size: int,
) -> torch.Tensor:  # [gamma, vocab]
    """q for a deterministic drafter (n-gram lookup): all mass on the proposed token."""
    probs = torch.zeros(draft_tokens.shape[0], vocab_size, device=draft_tokens.device)
    return probs.scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)


NORMALIZATION_TOLERANCE = 1e-3  # |sum of a row - 1| allowed in probabilities (float32 softmax of a big vocabulary)


def check_probabilities(name: str, probs: torch.Tensor, rows: int, vocab: int | None = None) -> None:
    """ValueError naming ``name`` unless probs is [rows, vocab] of finite, non-negative rows that
    each sum to 1 (logits, or unnormalized weights, would silently change the law)."""
    if probs.dim() != 2 or probs.shape[0] != rows or (vocab is not None and probs.shape[1] != vocab):
        want = f"[{rows}, {vocab if vocab is not None else 'vocab'}]"
        raise ValueError(f"{name} must have shape {want}, got {list(probs.shape)}")
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be floating point probabilities, got {probs.dtype}")
    if not bool(torch.isfinite(probs).all()):
        raise ValueError(f"{name} holds NaN or infinite values")
    if bool((probs < 0).any()):
        raise ValueError(f"{name} holds negative values: pass probabilities, not logits")
    sums = probs.double().sum(-1)
    if bool(((sums - 1).abs() > NORMALIZATION_TOLERANCE).any()):
        raise ValueError(f"{name} rows must sum to 1 (within {NORMALIZATION_TOLERANCE}); got sums "
                         f"{[round(float(v), 4) for v in sums[:4]]}: pass probabilities, not logits or weights")


def check_draft(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                draft_rows: int, used_rows: list[int] | None = None) -> None:
    """The checks of the public samplers: shapes, one vocabulary, proper distributions (of q,
    the rows that something was drawn from: ``used_rows``, default all), and token ids."""
    if draft_tokens.dim() != 1 or draft_tokens.is_floating_point():
        raise ValueError(
            f"draft tokens must be a 1-D integer tensor, got {list(draft_tokens.shape)} {draft_tokens.dtype}"
        )
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [rows, vocab], got shape {list(target_probs.shape)}")
    vocab = target_probs.shape[1]
    check_probabilities("target_probs", target_probs, target_probs.shape[0])
    if draft_tokens.numel() and not (0 <= int(draft_tokens.min()) and int(draft_tokens.max()) < vocab):
        raise ValueError(f"draft tokens must be token ids in [0, {vocab}), got {draft_tokens.tolist()[:8]}")
    if draft_probs is not None:
        if draft_probs.dim() == 2 and draft_probs.shape[1] != vocab:
            raise ValueError(
                f"draft_probs covers {draft_probs.shape[1]} tokens, target_probs {vocab}: "
                "q and p must be over one vocabulary"
            )
        if draft_probs.dim() != 2 or draft_probs.shape[0] != draft_rows:
            raise ValueError(f"draft_probs must have shape [{draft_rows}, {vocab}], got {list(draft_probs.shape)}")
        rows = draft_probs if used_rows is None else draft_probs[used_rows]
        check_probabilities("draft_probs", rows, rows.shape[0], vocab)


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

    def parent_rows(self) -> torch.Tensor:  # [nodes]
        """The row of the target's output each node was drafted at: its parent's (its block's first
        row, the last context token, for the root's children)."""
        counts = self.cu_nodes[1:] - self.cu_nodes[:-1]
        request = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
        return self.cu_nodes[:-1][request] + request + self.parents + 1


@dataclass(frozen=True)
class RejectionDecision:
    """How the sampler judged one request's draft (what ``specdec explain`` shows)."""

    acceptance: torch.Tensor  # [nodes]: min(1, p(x) / q(x)) node x was judged by (untried: as a first sibling)
    uniforms: torch.Tensor  # [nodes]: a tried node is accepted when its uniform is below its acceptance
    final_dist: torch.Tensor  # [vocab]: what the target's token was drawn from


@dataclass
class NodeState:
    """p and q where a walk stands, computed only when needed: until then p is row ``p_row`` of the
    target's probabilities, minus node ``q_node``'s q (the residual) if >= 0."""

    p_row: int
    q_node: int = -1
    p: torch.Tensor | None = None  # [vocab]
    q: torch.Tensor | None = None  # [vocab], q without the siblings rejected so far


@dataclass(frozen=True)
class JudgedBatch:
    """A batch after its first-sibling tests, on the host: what a walk down one request's tree reads."""

    passed: list[int]  # [nodes]: 1 where the node's uniform is below its acceptance as a first sibling
    uniforms: torch.Tensor  # [nodes]
    tokens: list[int]  # [nodes]
    node_q: torch.Tensor  # [nodes, vocab]: q each node was drawn from
    target_probs: torch.Tensor  # [nodes + batch, vocab]
    tried: dict[int, float] = field(default_factory=dict)  # a later sibling -> the acceptance it was judged by

    def walk(self, children: dict[int, list[int]],  # a request's tree: node -> its children, in the order drawn
             start: int,  # the request's first node in the batch
             root_row: int,  # its row of p at the root
             guesses: bool,  # no q: each sibling a point mass of its own
             relaxation: Relaxation | None) -> tuple[list[int], NodeState]:  # accepted path, where it stopped
        state, path = NodeState(root_row), list[int]()
        while True:
            accepted, siblings = None, children.get(path[-1] if path else -1, [])
            for child in siblings:
                at = start + child
                if state.q_node < 0:  # the first child tried here: judged in the batch's tensor operation
                    if self.passed[at]:
                        accepted = child
                        break
                    state.q_node = at
                    continue
                if state.p is None:  # a later sibling: the walk needs p and q after the rejections
                    state.p, state.q = sibling_rejection_step(self.target_probs[state.p_row],
                                                              self.node_q[state.q_node], self.tokens[state.q_node])[1:]
                q = self.node_q[at] if guesses else state.q
                assert q is not None  # set with p
                accept, p_rejected, q_rejected = sibling_rejection_step(state.p, q, self.tokens[at])
                self.tried[at] = float(accept)
                if bool(self.uniforms[at] < accept):
                    accepted = child
                    break
                state.p, state.q = p_rejected, q_rejected
            if accepted is None and relaxation is not None:
                accepted = relaxation.fallback(siblings)
            if accepted is None:
                return path, state
            path.append(accepted)
            state = NodeState(root_row + accepted + 1)


def rejection_sample_ragged(
    drafts: RaggedDrafts,  # chains and trees: siblings in the order they were drawn
    draft_probs: Sequence[torch.Tensor | None],  # per request [nodes_r, vocab]: q node i was drawn from; None = guesses
    target_probs: torch.Tensor,  # [nodes + batch, vocab]: per request p at the root, then after each node
    generators: Sequence[torch.Generator | None],  # [batch]: each request's own
    relaxations: Sequence[Relaxation | None] | None = None,  # per request: LOSSY acceptance (specdec.core.acceptance)
    decisions: list[RejectionDecision] | None = None,  # given: each request's decision is appended
) -> list[tuple[torch.Tensor, list[int]]]:  # per request: emitted [m + 1] int64, the accepted path [m]
    """The rejection sampler, for a batch of requests at once (a single request is a batch of one).

    Chains (Leviathan et al. 2023 Algorithm 1): accept drafted x with probability min(1, p(x) / q(x))
    until the first rejection, then draw from norm(max(0, p - q)) there, or from p after the last
    draft. Trees (Jeon et al. 2024, recursive rejection sampling): try a node's children in the
    order drawn; on a rejection p <- norm(max(0, p - q)) and q <- q without x (drawn without
    replacement), renormalised; an accepted child becomes the node; with every child rejected,
    draw from the current p. Guesses with no q (None) are point masses, each sibling its own.

    Each request draws from its own generator one uniform per node (in q's precision), then its
    token: its samples are what it gets alone, whatever its neighbours, and a chain draws the same
    as a chain or a tree. The tests of every first child are one tensor operation and one host
    sync; a later sibling (trees) costs a sync of its own."""
    starts = drafts.cu_nodes.tolist()
    counts = [end - start for start, end in zip(starts, starts[1:], strict=False)]
    vocab, device = target_probs.shape[1], target_probs.device
    dtype = next((q.dtype for q in draft_probs if q is not None), target_probs.dtype)
    pieces = [point_mass_probs(tokens, vocab).to(dtype) if q is None else q[: tokens.shape[0]]
              for tokens, q in zip(drafts.tokens.split(counts), draft_probs, strict=True)]
    node_q = pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else \
        torch.zeros(0, vocab, dtype=dtype, device=device)  # [nodes, vocab]
    target_probs = target_probs.to(dtype)
    p_x = target_probs[drafts.parent_rows(), drafts.tokens]  # [nodes]
    acceptance = judge(p_x, node_q.gather(-1, drafts.tokens[:, None])[:, 0])
    uniforms = torch.cat([torch.rand(count, generator=generator, device=device, dtype=dtype)
                          for count, generator in zip(counts, generators, strict=True)]) if counts else acceptance
    passed, tokens, parents = torch.stack([(uniforms < acceptance).long(), drafts.tokens, drafts.parents]).tolist()
    judged = JudgedBatch(passed, uniforms, tokens, node_q, target_probs)
    walks = []
    for r, (start, count) in enumerate(zip(starts, counts, strict=False)):
        children: dict[int, list[int]] = {}
        for node in range(count):
            children.setdefault(parents[start + node], []).append(node)
        walks.append(judged.walk(children, start, start + r, draft_probs[r] is None,
                                 None if relaxations is None else relaxations[r]))
    # The target's token: from p, or the residual after one rejection (one operation for the batch).
    states = [state for _, state in walks]
    rejected = [r for r, state in enumerate(states) if state.p is None and state.q_node >= 0]
    if rejected:
        rows = residual_distribution(node_q[[states[r].q_node for r in rejected]],
                                     target_probs[[states[r].p_row for r in rejected]])  # [rejected, vocab]
        for r, row in zip(rejected, rows, strict=False):
            states[r].p = row
    if decisions is not None and judged.tried:  # a later sibling was judged against updated p and q
        acceptance = acceptance.clone()
        acceptance[list(judged.tried)] = torch.tensor(list(judged.tried.values()), dtype=acceptance.dtype,
                                                      device=device)
    results = []
    for (path, state), start, count, generator in zip(walks, starts, counts, generators, strict=False):
        final = target_probs[state.p_row] if state.p is None else state.p
        token = torch.multinomial(final, 1, generator=generator)
        chain = path == list(range(len(path)))
        kept = drafts.tokens[start : start + len(path)] if chain else drafts.tokens[[start + node for node in path]]
        results.append((torch.cat([kept, token]), path))
        if decisions is not None:
            nodes = slice(start, start + count)
            decisions.append(RejectionDecision(acceptance[nodes], uniforms[nodes], final))
    return results


def rejection_sample(
    draft_tokens: torch.Tensor,  # [gamma] int64
    draft_probs: torch.Tensor | None,  # [gamma, vocab]; None = point masses on draft_tokens
    target_probs: torch.Tensor,  # [gamma + 1, vocab]
    generator: torch.Generator | None = None,
    validate: bool = True,  # the engine, which builds its inputs itself, skips the checks
    relaxation: Relaxation | None = None,
) -> torch.Tensor:  # [n_accepted + 1] int64
    """Speculative sampling of one chain (Leviathan et al. 2023 Algorithm 1; Chen et al. 2023):
    rejection_sample_ragged with a batch of one. The emitted tokens have the target's law."""
    gamma = draft_tokens.shape[0]
    if target_probs.shape[0] != gamma + 1:
        raise ValueError(f"target_probs needs gamma + 1 = {gamma + 1} rows, got {target_probs.shape[0]}")
    if validate:
        check_draft(draft_tokens, draft_probs, target_probs, gamma)
        drawn = None if draft_probs is None or not gamma else draft_probs.gather(-1, draft_tokens[:, None].long())
        if drawn is not None and bool((drawn <= 0).any()):
            raise ValueError("a draft token has probability 0 under draft_probs: it cannot have been drawn from q")
    drafts = RaggedDrafts.of([draft_tokens], [None], draft_tokens.device)
    return rejection_sample_ragged(drafts, [draft_probs], target_probs, [generator], [relaxation])[0][0]


def sibling_rejection_step(
    target_probs: torch.Tensor,  # [vocab], p at this node after the siblings rejected so far
    draft_probs: torch.Tensor,  # [vocab], q at this node without the siblings tried so far
    token: int,  # the next sibling, drawn from draft_probs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # acceptance [], p if rejected [vocab], q if rejected [vocab]
    """One sibling of recursive rejection sampling: accept with min(1, p(x) / q(x)); if rejected,
    the next sibling is judged against norm(max(p - q, 0)) and q without x (it was drawn
    without replacement), renormalised."""
    tiny = torch.finfo(draft_probs.dtype).tiny
    acceptance = judge(target_probs[token], draft_probs[token])
    residual = residual_distribution(draft_probs[None], target_probs[None])[0]
    remaining = draft_probs.clone()
    remaining[token] = 0.0
    return acceptance, residual, remaining / remaining.sum().clamp_min(tiny)


def tree_rejection_sample(
    tree_tokens: torch.Tensor,  # [n] int64, parents before children, siblings in the order drawn
    parents: torch.Tensor | Sequence[int],  # [n] int64: parent index, -1 for children of the root
    draft_probs: torch.Tensor | None,  # [n + 1, vocab]: row 0 = q at the root, row i + 1 = q at node i
    target_probs: torch.Tensor,  # [n + 1, vocab]: row 0 = p at the root, row i + 1 = p after node i
    generator: torch.Generator | None = None,
    validate: bool = True,  # the engine, which builds its inputs itself, skips the checks
    relaxation: Relaxation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # emitted [m + 1], path [m], int64
    """Recursive rejection sampling over a token tree (Jeon et al. 2024, "Recursive Speculative
    Decoding"): rejection_sample_ragged with a batch of one. draft_probs None means deterministic
    guesses: q is a point mass on each sibling in turn. The emitted tokens have the target's law."""
    parents = [int(parent) for parent in parents]
    count = tree_tokens.shape[0]
    if len(parents) != count or target_probs.shape[0] != count + 1:
        raise ValueError(
            f"a tree of {count} nodes needs {count} parents and {count + 1} rows of target_probs, "
            f"got {len(parents)} and {target_probs.shape[0]}"
        )
    if validate:
        if any(not -1 <= parent < index for index, parent in enumerate(parents)):
            raise ValueError(f"parents must list each node's parent before it (-1 = the root), got {parents}")
        # q is read only where children were drawn from: at the root and at inner nodes.
        check_draft(tree_tokens, draft_probs, target_probs, count + 1, sorted({parent + 1 for parent in parents}))
    node_q = None if draft_probs is None else draft_probs[[parent + 1 for parent in parents]]  # [n, vocab]
    drafts = RaggedDrafts.of([tree_tokens], [parents], tree_tokens.device)
    (emitted, path), = rejection_sample_ragged(drafts, [node_q], target_probs, [generator], [relaxation])
    return emitted, torch.tensor(path, dtype=torch.long)


def greedy_tree_verify(
    tree_tokens: torch.Tensor,  # [n] int64
    parents: torch.Tensor | Sequence[int],  # [n] int64
    target_logits: torch.Tensor,  # [n + 1, vocab]: row 0 after the committed context, row i + 1 after node i
) -> tuple[torch.Tensor, torch.Tensor]:  # emitted [m + 1], path [m], int64
    """Follow the target's argmax down the tree: the longest root-to-node path the target
    itself would have produced, then its next token."""
    return greedy_tree_verify_tokens(tree_tokens, parents, target_logits.argmax(-1))


def greedy_tree_verify_tokens(
    tree_tokens: torch.Tensor,  # [n] int64
    parents: torch.Tensor | Sequence[int],  # [n] int64
    target_tokens: torch.Tensor,  # [n + 1] int64, the target's argmax at the root and after each node
    relaxation: Relaxation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # emitted [m + 1], path [m], int64
    emitted, path = greedy_walk(tree_tokens.tolist(), [int(parent) for parent in parents], target_tokens.tolist(),
                                relaxation)
    return torch.tensor(emitted, dtype=torch.long, device=tree_tokens.device), torch.tensor(path, dtype=torch.long)
