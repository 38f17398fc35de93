"""A lookup-table language model whose distributions can be enumerated exactly.

The next-token logits depend on the previous two tokens through a random table, so the
engine, drafter, cache rollback and verifier all run for real, while the law of any short
continuation is a finite sum the tests can compute.
"""

from __future__ import annotations

import torch

from specdec.models.base import Attention, ForwardOutput, LanguageModel, check_forward


class TokenCache:
    """Rows of committed tokens; a forward's new tokens are looked at, never stored, until the
    engine commits them (then they are read back from the pending block)."""

    def __init__(self, max_length: int, rows: int = 1) -> None:
        self.tokens = torch.zeros(rows, max_length, dtype=torch.long)
        self.max_length, self.rows = max_length, rows
        self.lengths = [0] * rows

    def reserve(self, capacity: int) -> None:
        """Preallocated at max_length."""

    def ensure(self, row: int, length: int) -> None:
        """Preallocated at max_length."""

    def commit(self, row: int, count: int) -> None:
        self.lengths[row] += count

    def rollback(self, row: int, length: int) -> None:
        assert 0 <= length <= self.lengths[row]
        self.lengths[row] = length

    def fork(self, source: int, row: int, length: int) -> None:
        assert row != source and 0 <= length <= self.lengths[source]
        self.tokens[row, :length] = self.tokens[source, :length]
        self.lengths[row] = length

    def compact(self, row: int, keep) -> None:
        start = self.lengths[row]
        self.tokens[row, start : start + len(keep)] = self.tokens[row, [start + k for k in keep]]
        self.lengths[row] += len(keep)


class TableNetwork:
    def __init__(self, vocab_size: int, seed: int, sharpness: float = 1.5) -> None:
        generator = torch.Generator().manual_seed(seed)
        # [previous-but-one (or vocab_size for "none"), previous, next]
        self.table = sharpness * torch.randn(vocab_size + 1, vocab_size, vocab_size, generator=generator)
        self.vocab_size = vocab_size

    def new_cache(self, max_length: int, rows: int = 1) -> TokenCache:
        return TokenCache(max_length, rows)

    def __call__(self, tokens, positions, cache: TokenCache, attention: Attention, want_logits=True,
                 hidden_layers=()) -> ForwardOutput:  # logits [n, vocab]
        check_forward(tokens, positions, cache, attention)
        logits = []
        for segment, start, end in zip(attention.segments, attention.offsets, attention.offsets[1:], strict=False):
            row, committed, written = segment.row, cache.lengths[segment.row], segment.written
            cache.tokens[row, committed + written : committed + written + segment.count] = tokens[start:end]
            history = cache.tokens[row, :committed].tolist()
            new = cache.tokens[row, committed : committed + written + segment.count].tolist()  # the tree so far
            parents = segment.parents or tuple(range(-1, segment.count - 1))  # a chain: each after the last
            for node in range(written, written + segment.count):
                path, at = [], node
                while at >= 0:
                    path.append(new[at])
                    at = parents[at]
                logits.append(self.logits(history + path[::-1]))
        return ForwardOutput(torch.stack(logits) if want_logits else None)

    def logits(self, prefix: list[int]) -> torch.Tensor:  # [vocab], next-token logits after prefix
        before = prefix[-2] if len(prefix) > 1 else self.vocab_size
        return self.table[before, prefix[-1]]


def table_model(vocab_size: int, seed: int, sharpness: float = 1.5, max_context: int = 64) -> LanguageModel:
    return LanguageModel(
        network=TableNetwork(vocab_size, seed, sharpness), tokenizer=None, name=f"table-{seed}",
        vocab_size=vocab_size, max_context=max_context,
    )
