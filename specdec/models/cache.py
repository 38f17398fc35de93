"""A preallocated KV cache indexed by absolute position (as in gpt-fast), with explicit verbs
(as in nanochat's engine): ``reserve``, ``write``, ``advance``, ``crop``, ``reset``.

Everything at or past ``length`` is garbage that the next forward overwrites, so rolling back
rejected draft tokens is ``crop(new_length)``: a pointer move, nothing is copied or freed.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype,
        device: torch.device | str,
        initial_capacity: int = 256,
    ) -> None:
        self.max_length = max_length
        self.length = 0
        self._shape = (num_layers, num_kv_heads, 0, head_dim)
        self._dtype, self._device = dtype, torch.device(device)
        self.keys = self.values = torch.empty(self._shape, dtype=dtype, device=self._device)
        self.reserve(min(initial_capacity, max_length))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` positions. Engines call this once per generation with the
        longest length they can reach, so the decoding loop itself never allocates."""
        capacity = min(capacity, self.max_length)
        if capacity <= self.capacity:
            return
        # Grow geometrically so that callers who do not reserve still pay O(log n) copies.
        capacity = min(max(capacity, 2 * self.capacity), self.max_length)
        layers, heads, _, head_dim = self._shape
        shape = (layers, heads, capacity, head_dim)
        keys = torch.empty(shape, dtype=self._dtype, device=self._device)
        values = torch.empty(shape, dtype=self._dtype, device=self._device)
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values

    def positions(self, num_tokens: int) -> torch.Tensor:  # [num_tokens] int64
        """Absolute positions of the next ``num_tokens`` tokens."""
        return torch.arange(self.length, self.length + num_tokens, device=self._device)

    def write(
        self,
        layer: int,
        keys: torch.Tensor,  # [kv_heads, k, head_dim]
        values: torch.Tensor,  # [kv_heads, k, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [kv_heads, length + k, head_dim]
        """Store the new tokens' keys and values at positions length.., return all valid ones."""
        end = self.length + keys.shape[1]
        if end > self.capacity:
            raise RuntimeError(f"KV cache holds {self.capacity} positions, {end} needed; call reserve() first")
        self.keys[layer, :, self.length : end] = keys
        self.values[layer, :, self.length : end] = values
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def advance(self, num_tokens: int) -> None:
        """Commit the positions just written by every layer."""
        self.length += num_tokens

    def crop(self, length: int) -> None:
        """Roll back to ``length`` valid positions (drop rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0
