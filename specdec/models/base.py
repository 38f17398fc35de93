"""What the engine needs of a model, whichever forward runs it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Cache(Protocol):
    """Per-sequence attention state. ``length`` positions are valid; ``crop`` rolls back."""

    length: int

    def reserve(self, capacity: int) -> None: ...
    def crop(self, length: int) -> None: ...
    def reset(self) -> None: ...


class Network(Protocol):
    """A causal LM forward that keeps all per-sequence state in a cache it creates."""

    def new_cache(self, max_length: int) -> Cache: ...

    def __call__(
        self,
        tokens: torch.Tensor,  # [k] int64, fed at positions cache.length .. cache.length + k - 1
        cache: Cache,
    ) -> torch.Tensor: ...  # [k, vocab] logits


@dataclass
class LanguageModel:
    """A loaded model: its forward, its tokenizer and what the engine must know about it."""

    network: Network
    tokenizer: Any  # a transformers tokenizer, or None for token-id-only use
    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    backend: str = "specdec"  # "specdec" (own forward) or "transformers" (adapter)
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    path: str | None = None  # the folder it was loaded from

    def new_cache(self) -> Cache:
        return self.network.new_cache(self.max_context)

    def forward(
        self,
        tokens: torch.Tensor,  # [k] int64
        cache: Cache,
    ) -> torch.Tensor:  # [k, vocab] logits
        return self.network(tokens, cache)
