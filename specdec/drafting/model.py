"""A smaller language model as the drafter."""

from __future__ import annotations

import torch

from specdec.drafting.base import Draft
from specdec.models.base import LanguageModel
from specdec.sampling import SamplingParams, logits_to_probs


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(a.shape[0], b.shape[0])
    mismatches = (a[:n] != b[:n]).nonzero()
    return int(mismatches[0, 0]) if mismatches.numel() else n


class ModelDrafter:
    """Drafts autoregressively with its own model and KV cache.

    It remembers which tokens its cache holds; at each step it rolls the cache back to the
    longest prefix that agrees with the verified context (a pointer move) and feeds the rest,
    usually the accepted tokens and the target's own token.
    """

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.cache = model.new_cache()
        self._fed = torch.empty(model.max_context, dtype=torch.long, device=model.device)  # tokens in cache

    def reset(self) -> None:
        self.cache.reset()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Nothing to learn: the next propose() reconciles the cache with the context."""

    def propose(
        self,
        context: torch.Tensor,  # [n] int64
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        # The cache will hold the context plus gamma - 1 drafted tokens.
        gamma = min(gamma, self.model.max_context - context.shape[0] + 1)
        if gamma <= 0:
            return Draft.empty(context.device)
        kept = min(common_prefix_length(self._fed[: self.cache.length], context), context.shape[0] - 1)
        self.cache.crop(kept)
        self.cache.reserve(context.shape[0] + gamma)
        self._fed[kept : context.shape[0]] = context[kept:]
        logits = self.model.forward(context[kept:], self.cache)[-1:]  # [1, vocab]
        tokens, probs = [], []
        for i in range(gamma):
            if sampling.greedy:
                token = logits.argmax(-1)  # [1]
            else:
                step_probs = logits_to_probs(logits, sampling)  # [1, vocab]
                token = torch.multinomial(step_probs, 1, generator=generator)[0]
                probs.append(step_probs)
            tokens.append(token)
            if i + 1 < gamma:
                self._fed[self.cache.length] = token
                logits = self.model.forward(token, self.cache)
        return Draft(torch.cat(tokens), torch.cat(probs) if probs else None)
