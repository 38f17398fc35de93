"""Verification of a drafted chain: pure functions on tensors, no models, no caches.

Notation (Leviathan et al. 2023, Algorithm 1): p = target, q = draft. The drafter proposed
``gamma`` tokens; the target scored all of them in one forward pass, giving ``gamma + 1``
distributions (one per draft position plus the "bonus" position after the last draft).
Both verifiers return the emitted tokens: the accepted drafts, then exactly one token chosen
by the target (its correction at the first rejected position, or the bonus token).
"""

from __future__ import annotations

import torch


def greedy_verify(
    draft_tokens: torch.Tensor,  # [gamma] int64
    target_logits: torch.Tensor,  # [gamma + 1, vocab]
) -> torch.LongTensor:  # [n_accepted + 1]
    """Longest prefix of the draft that equals the target's argmax, then the target's token."""
    return greedy_verify_tokens(draft_tokens, target_logits.argmax(-1))


def greedy_verify_tokens(
    draft_tokens: torch.Tensor,  # [gamma] int64
    target_tokens: torch.Tensor,  # [gamma + 1] int64, the target's argmax at each position
) -> torch.LongTensor:  # [n_accepted + 1]
    """greedy_verify with the argmax already taken (an engine takes it once for a whole batch)."""
    gamma = draft_tokens.shape[0]
    if gamma == 0:
        return target_tokens[:1].clone()
    matches = draft_tokens == target_tokens[:gamma]
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


def rejection_sample(
    draft_tokens: torch.Tensor,  # [gamma] int64
    draft_probs: torch.Tensor | None,  # [gamma, vocab]; None = point masses on draft_tokens
    target_probs: torch.Tensor,  # [gamma + 1, vocab]
    generator: torch.Generator | None = None,
) -> torch.LongTensor:  # [n_accepted + 1]
    """Speculative sampling (Leviathan et al. 2023 Algorithm 1; Chen et al. 2023).

    Accept drafted x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection
    emit a sample of norm(max(0, p_i - q_i)) and stop; if all are accepted, emit a sample of
    p_gamma (the bonus token). The emitted tokens are distributed exactly as the target's.
    """
    gamma = draft_tokens.shape[0]
    if target_probs.shape[0] != gamma + 1:
        raise ValueError(f"target_probs needs gamma + 1 = {gamma + 1} rows, got {target_probs.shape[0]}")
    if draft_probs is None:
        draft_probs = point_mass_probs(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
    target_probs = target_probs.to(draft_probs.dtype)
    uniforms = torch.rand(gamma, generator=generator, device=draft_tokens.device, dtype=draft_probs.dtype)
    accepted = uniforms < acceptance_probs(draft_tokens, draft_probs, target_probs)
    n_accepted = int(accepted.cumprod(0).sum()) if gamma else 0
    if n_accepted < gamma:
        final_dist = residual_distribution(draft_probs[n_accepted], target_probs[n_accepted])
    else:
        final_dist = target_probs[gamma]
    final_token = torch.multinomial(final_dist, 1, generator=generator)
    return torch.cat([draft_tokens[:n_accepted], final_token])
