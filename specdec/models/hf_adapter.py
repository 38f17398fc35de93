"""Any transformers causal LM behind specdec's Network interface: slower than the own forward
(per-op overhead, a dynamic cache), but it runs architectures the lean forward does not."""

from __future__ import annotations

import torch
from torch import nn


class HFCache:
    """transformers' DynamicCache with the verbs of specdec's KVCache; rollback crops it.

    Built without the model config so every layer keeps its full history: sliding-window layers
    that drop old states could not be rolled back. The model's masks still apply the window."""

    def __init__(self, max_length: int) -> None:
        from transformers import DynamicCache

        self.max_length = max_length
        self.inner = DynamicCache()
        self.length = 0

    def reserve(self, capacity: int) -> None:
        """A dynamic cache grows by itself."""

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        if length < self.length:
            self.inner.crop(length - self.length)  # a negative count removes that many
        self.length = length

    def reset(self) -> None:
        from transformers import DynamicCache

        self.inner = DynamicCache()
        self.length = 0


class HFNetwork:
    def __init__(self, model: nn.Module) -> None:
        self.model = model.eval()

    def new_cache(self, max_length: int) -> HFCache:
        return HFCache(max_length)

    @torch.inference_mode()
    def __call__(
        self,
        tokens: torch.Tensor,  # [k] int64
        cache: HFCache,
    ) -> torch.Tensor:  # [k, vocab] logits
        num_tokens = tokens.shape[0]
        if cache.length + num_tokens > cache.max_length:
            raise ValueError(f"position {cache.length + num_tokens - 1} is past the context length {cache.max_length}")
        positions = torch.arange(cache.length, cache.length + num_tokens, device=tokens.device)
        output = self.model(
            input_ids=tokens[None], position_ids=positions[None], past_key_values=cache.inner, use_cache=True,
        )
        cache.length += num_tokens
        return output.logits[0]
