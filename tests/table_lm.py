"""A lookup-table language model whose distributions can be enumerated exactly.

The next-token logits depend on the previous two tokens through a random table, so the
engine, drafter, cache rollback and verifier all run for real, while the law of any short
continuation is a finite sum the tests can compute.
"""

from __future__ import annotations

import torch

from specdec.models.base import LanguageModel


class TokenCache:
    def __init__(self, max_length: int) -> None:
        self.tokens = torch.zeros(max_length, dtype=torch.long)
        self.max_length = max_length
        self.length = 0

    def reserve(self, capacity: int) -> None:
        """Preallocated at max_length."""

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length

    def reset(self) -> None:
        self.length = 0


class TableNetwork:
    def __init__(self, vocab_size: int, seed: int, sharpness: float = 1.5) -> None:
        generator = torch.Generator().manual_seed(seed)
        # [previous-but-one (or vocab_size for "none"), previous, next]
        self.table = sharpness * torch.randn(vocab_size + 1, vocab_size, vocab_size, generator=generator)
        self.vocab_size = vocab_size

    def new_cache(self, max_length: int) -> TokenCache:
        return TokenCache(max_length)

    def __call__(self, tokens: torch.Tensor, cache: TokenCache) -> torch.Tensor:  # [k, vocab]
        start = cache.length
        cache.tokens[start : start + tokens.shape[0]] = tokens
        cache.length += tokens.shape[0]
        return torch.stack([self.logits(cache.tokens[: start + i + 1].tolist()) for i in range(tokens.shape[0])])

    def logits(self, prefix: list[int]) -> torch.Tensor:  # [vocab], next-token logits after prefix
        before = prefix[-2] if len(prefix) > 1 else self.vocab_size
        return self.table[before, prefix[-1]]


def table_model(vocab_size: int, seed: int, sharpness: float = 1.5, max_context: int = 64) -> LanguageModel:
    return LanguageModel(
        network=TableNetwork(vocab_size, seed, sharpness), tokenizer=None, name=f"table-{seed}",
        vocab_size=vocab_size, max_context=max_context,
    )
