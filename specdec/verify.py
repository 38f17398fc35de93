"""Verification of a drafted chain: pure functions on tensors, no models, no caches.

Notation (Leviathan et al. 2023, Algorithm 1): p = target, q = draft. The drafter proposed
``gamma`` tokens; the target scored all of them in one forward pass, giving ``gamma + 1``
distributions (one per draft position plus the "bonus" position after the last draft).
Both verifiers return the emitted tokens: the accepted drafts, then exactly one token chosen
by the target (its correction at the first rejected position, or the bonus token).

Each verifier takes an optional ``relaxation`` (specdec.acceptance, LOSSY and opt-in): where the
exact test turns a draft down, a token its relaxed set admits is kept all the same. None (the
default) runs the lossless verifier unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specdec.acceptance import Relaxation


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
    gamma = draft_tokens.shape[0]
    if gamma == 0:
        return target_tokens[:1].clone()
    matches = draft_tokens == target_tokens[:gamma]
    if relaxation is not None:  # a kept draft may differ from the target's token: emit the draft's
        kept = relaxation.accepted_length(matches)
        return torch.cat([draft_tokens[:kept], target_tokens[kept : kept + 1]])
    n_accepted = int(matches.cumprod(0).sum())
    return target_tokens[: n_accepted + 1].clone()


def acceptance_probs(
    draft_tokens: torch.Tensor,  # [gamma] int64
    draft_probs: torch.Tensor,  # [gamma, vocab]
    target_probs: torch.Tensor,  # [gamma + 1, vocab] (only the first gamma rows are read)
) -> torch.Tensor:  # [gamma] float, min(1, p(x) / q(x)) for each drafted x
    index = draft_tokens.unsqueeze(-1)
    p_x = target_probs[: draft_tokens.shape[0]].gather(-1, index).squeeze(-1)
    q_x = draft_probs.gather(-1, index).squeeze(-1)
    # q_x > 0 for any token actually sampled from q; the clamp only guards the division.
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


def rejection_sample(
    draft_tokens: torch.Tensor,  # [gamma] int64
    draft_probs: torch.Tensor | None,  # [gamma, vocab]; None = point masses on draft_tokens
    target_probs: torch.Tensor,  # [gamma + 1, vocab]
    generator: torch.Generator | None = None,
    validate: bool = True,  # the engine, which builds its inputs itself, skips the checks
    relaxation: Relaxation | None = None,
) -> torch.Tensor:  # [n_accepted + 1] int64
    """Speculative sampling (Leviathan et al. 2023 Algorithm 1; Chen et al. 2023).

    Accept drafted x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
    emit a sample of norm(max(0, p_i - q_i)) and stop; if all are accepted, emit a sample of
    p_gamma (the bonus token). The emitted tokens are distributed exactly as the target's.
    """
    gamma = draft_tokens.shape[0]
    if target_probs.shape[0] != gamma + 1:
        raise ValueError(f"target_probs needs gamma + 1 = {gamma + 1} rows, got {target_probs.shape[0]}")
    if validate:
        check_draft(draft_tokens, draft_probs, target_probs, gamma)
        if (
            draft_probs is not None
            and gamma
            and bool((draft_probs.gather(-1, draft_tokens[:, None].long()) <= 0).any())
        ):
            raise ValueError("a draft token has probability 0 under draft_probs: it cannot have been drawn from q")
    if draft_probs is None:
        draft_probs = point_mass_probs(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
    target_probs = target_probs.to(draft_probs.dtype)
    uniforms = torch.rand(gamma, generator=generator, device=draft_tokens.device, dtype=draft_probs.dtype)
    accepted = uniforms < acceptance_probs(draft_tokens, draft_probs, target_probs)
    n_accepted = int(accepted.cumprod(0).sum()) if gamma else 0
    if relaxation is not None:
        n_accepted = relaxation.accepted_length(accepted)
    if n_accepted < gamma:
        final_dist = residual_distribution(draft_probs[n_accepted], target_probs[n_accepted])
    else:
        final_dist = target_probs[gamma]
    final_token = torch.multinomial(final_dist, 1, generator=generator)
    return torch.cat([draft_tokens[:n_accepted], final_token])


def children_of(parents: list[int], node: int) -> list[int]:
    """Tree indices of node's children (-1 = the root), in tree order (the order drawn)."""
    return [i for i, parent in enumerate(parents) if parent == node]


def sibling_rejection_step(
    target_probs: torch.Tensor,  # [vocab], p at this node after the siblings rejected so far
    draft_probs: torch.Tensor,  # [vocab], q at this node without the siblings tried so far
    token: int,  # the next sibling, drawn from draft_probs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # acceptance [], p if rejected [vocab], q if rejected [vocab]
    """One sibling of recursive rejection sampling: accept with min(1, p(x) / q(x)); if rejected,
    the next sibling is judged against norm(max(p - q, 0)) and q without x (it was drawn
    without replacement), renormalised."""
    tiny = torch.finfo(draft_probs.dtype).tiny
    acceptance = torch.clamp(target_probs[token] / draft_probs[token].clamp_min(tiny), max=1.0)
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
    Decoding"): at a node, try its children in the order they were drawn (without replacement
    from the node's q). Accept child x with probability min(1, p(x) / q(x)); on rejection
    p <- norm(max(p - q, 0)) and q <- q without x, renormalised; an accepted child becomes the
    node. When every child is rejected (or the node is a leaf), emit a sample of the current p.
    draft_probs None means deterministic guesses: q is a point mass on each sibling in turn.
    A chain gives exactly rejection_sample's law; the emitted tokens have the target's law."""
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
    tokens = tree_tokens.tolist()
    dtype = torch.float64 if draft_probs is None else draft_probs.dtype
    node, path = -1, list[int]()
    while True:
        p = target_probs[node + 1].to(dtype)
        q = None if draft_probs is None else draft_probs[node + 1].to(dtype)
        accepted = None
        for child in children_of(parents, node):
            x = tokens[child]
            q_x = point_mass_probs(tree_tokens[child : child + 1], p.shape[-1])[0].to(dtype) if q is None else q
            accept, p_rejected, q_rejected = sibling_rejection_step(p, q_x, x)
            if torch.rand((), generator=generator, device=p.device, dtype=dtype) < accept:
                accepted = child
                break
            p, q = p_rejected, None if q is None else q_rejected
        if accepted is None and relaxation is not None:
            accepted = relaxation.fallback(children_of(parents, node))
        if accepted is None:
            final = torch.multinomial(p, 1, generator=generator)
            emitted = torch.tensor([tokens[i] for i in path], dtype=torch.long, device=tree_tokens.device)
            return torch.cat([emitted, final.to(tree_tokens.device)]), torch.tensor(path, dtype=torch.long)
        path.append(accepted)
        node = accepted


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
    parents = [int(parent) for parent in parents]
    tokens, best = tree_tokens.tolist(), target_tokens.tolist()
    node, path = -1, list[int]()
    while True:
        match = next((child for child in children_of(parents, node) if tokens[child] == best[node + 1]), None)
        if match is None and relaxation is not None:
            match = relaxation.fallback(children_of(parents, node))
        if match is None:
            emitted = [tokens[i] for i in path] + [best[node + 1]]
            return (
                torch.tensor(emitted, dtype=torch.long, device=tree_tokens.device),
                torch.tensor(path, dtype=torch.long),
            )
        path.append(match)
        node = match
