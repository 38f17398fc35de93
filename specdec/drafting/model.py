"""A smaller language model as the drafter."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdec.drafting.base import Draft
from specdec.models.base import LanguageModel
from specdec.sampling import SamplingParams, logits_to_probs

#: Called after each drafted token with (tokens drafted so far, their chain probability under q);
#: True stops drafting. Draft-length policies supply it (see specdec.policy).
StopRule = Callable[[int, float], bool]


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(a.shape[0], b.shape[0])
    mismatches = (a[:n] != b[:n]).nonzero()
    return int(mismatches[0, 0]) if mismatches.numel() else n


class DraftModelState:
    """A draft model with its own KV cache and a record of the tokens that cache holds.

    Each step it rolls the cache back to the longest prefix that agrees with the verified
    context (a pointer move) and feeds the rest, usually the accepted tokens and the target's
    own token.
    """

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.cache = model.new_cache()
        self.fed = torch.empty(model.max_context, dtype=torch.long, device=model.device)  # [max_context]

    def reset(self) -> None:
        self.cache.reset()

    def room(self, context_length: int) -> int:
        """How many tokens can still be drafted after context_length (the cache will hold the
        context plus all drafted tokens but the last)."""
        return self.model.max_context - context_length + 1

    def start_draft(self, context_length: int, gamma: int) -> int:
        """gamma clamped to the room left, with the cache reserved for it; 0 = draft nothing."""
        gamma = min(gamma, self.room(context_length))
        if gamma > 0:
            self.cache.reserve(context_length + gamma)
        return max(gamma, 0)

    def catch_up(self, context: torch.Tensor) -> torch.Tensor:  # context [n] -> pending [m >= 1]
        """Crop the cache to what agrees with context; return the context tokens still to feed
        (always at least the last one, whose logits give q for the first draft)."""
        kept = min(common_prefix_length(self.fed[: self.cache.length], context), context.shape[0] - 1)
        self.cache.crop(kept)
        return context[kept:]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [k] -> logits [k, vocab]
        start = self.cache.length
        self.fed[start : start + tokens.shape[0]] = tokens
        return self.model.forward(tokens, self.cache)


def sample_from_logits(
    logits: torch.Tensor,  # [1, vocab]
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # token [1], q [1, vocab] (None when greedy)
    if sampling.greedy:  # greedy verification needs no q: skip building it
        return logits.argmax(-1), None
    probs = logits_to_probs(logits, sampling)
    return torch.multinomial(probs, 1, generator=generator)[0], probs


def token_confidence(
    logits: torch.Tensor,  # [1, vocab]
    probs: torch.Tensor | None,  # [1, vocab], q (None when greedy)
    token: torch.Tensor,  # [1]
    sampling: SamplingParams,
) -> float:
    """The draft's probability of its token: q(token), or the plain softmax when greedy (where q
    would be a point mass and says nothing about how sure the draft is)."""
    source = logits.float().softmax(-1) if sampling.greedy else probs
    return float(source[0, token])


class ModelDrafter:
    """Drafts autoregressively with its own model and KV cache."""

    def __init__(self, model: LanguageModel) -> None:
        self.state = DraftModelState(model)
        self.vocab_size = model.vocab_size

    def reset(self) -> None:
        self.state.reset()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Nothing to learn: the next propose() reconciles the cache with the context."""

    def propose(
        self,
        context: torch.Tensor,  # [n] int64
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stop_early: StopRule | None = None,
    ) -> Draft:
        gamma = self.state.start_draft(context.shape[0], gamma)
        if gamma == 0:
            return Draft.empty(context.device)
        logits = self.state.forward(self.state.catch_up(context))[-1:]  # [1, vocab]
        tokens, probs, chain_probability = [], [], 1.0
        while True:
            token, step_probs = sample_from_logits(logits, sampling, generator)
            tokens.append(token)
            if step_probs is not None:
                probs.append(step_probs)
            if len(tokens) == gamma:
                break
            if stop_early is not None:
                chain_probability *= token_confidence(logits, step_probs, token, sampling)
                if stop_early(len(tokens), chain_probability):
                    break
            logits = self.state.forward(token)
        return Draft(torch.cat(tokens), torch.cat(probs) if probs else None)
