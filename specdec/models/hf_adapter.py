"""Any transformers causal LM behind specdec's Network interface: slower than the own forward
(per-op overhead, a dynamic cache), but it runs architectures the lean forward does not.

Chains only: a tree would need a 4D mask that not every architecture's attention honours, so
trees are refused with a clear error (use the own forward, `--backend specdec`, for trees).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specdec.models.base import Attention, ForwardOutput, check_forward, check_hidden_layers


class HFCache:
    """One transformers DynamicCache per row, with the verbs of specdec's KVCache.

    A forward appends to the DynamicCache; ``lengths`` says how much of it is committed, and
    the next verb or forward crops the rest. Built without the model config so every layer keeps
    its full history: sliding-window layers that drop old states could not be rolled back. The
    model's masks still apply the window."""

    def __init__(self, max_length: int, rows: int = 1) -> None:
        self.max_length, self.rows = max_length, rows
        self.lengths = [0] * rows
        self.inner = [self._new_inner() for _ in range(rows)]
        self.stored = [0] * rows  # what each DynamicCache holds, committed or not

    @staticmethod
    def _new_inner():
        from transformers import DynamicCache

        return DynamicCache()

    def reserve(self, capacity: int) -> None:
        """A dynamic cache grows by itself."""

    def ensure(self, row: int, length: int) -> None:
        """Nothing to take: see reserve."""

    def trim(self, row: int) -> None:
        """Drop what a forward wrote past the committed length."""
        excess = self.stored[row] - self.lengths[row]
        if excess > 0:
            self.inner[row].crop(-excess)  # a negative count removes that many
        self.stored[row] = self.lengths[row]

    def commit(self, row: int, count: int) -> None:
        if not 0 <= count <= self.stored[row] - self.lengths[row]:
            raise ValueError(f"cannot commit {count} slots to row {row} of length {self.lengths[row]}")
        self.lengths[row] += count
        self.trim(row)

    def rollback(self, row: int, length: int) -> None:
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"cannot roll row {row} of length {self.lengths[row]} back to {length}")
        self.lengths[row] = length
        self.trim(row)

    def compact(self, row: int, keep: Sequence[int]) -> None:
        """Only a chain prefix can be kept here (the adapter runs no trees)."""
        if list(keep) != list(range(len(keep))):
            raise ValueError("the transformers adapter keeps chain prefixes only; trees need --backend specdec")
        self.commit(row, len(keep))


class HFNetwork:
    def __init__(self, model: nn.Module) -> None:
        self.model = model.eval()

    def new_cache(self, max_length: int, rows: int = 1) -> HFCache:
        return HFCache(max_length, rows)

    @torch.inference_mode()
    def __call__(
        self,
        tokens: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        cache: HFCache,
        attention: Attention,
        want_logits: bool = True,
        hidden_layers: tuple[int, ...] = (),  # decoder layers whose outputs to return, concatenated
    ) -> ForwardOutput:
        check_forward(tokens, positions, cache, attention)
        num_layers = self.model.config.num_hidden_layers
        check_hidden_layers(hidden_layers, num_layers)
        if num_layers - 1 in hidden_layers:  # transformers returns it after the final norm, unlike every other
            raise ValueError(f"the transformers adapter gives no pre-norm output of the last layer ({num_layers - 1}); "
                             "ask for earlier layers (a draft head reads layers below L - 3)")
        if attention.has_trees:
            raise ValueError("the transformers adapter verifies chains only; use --backend specdec for token trees")
        offsets = attention.offsets
        logits, hidden = [], []
        # One model call per segment: each row has its own DynamicCache (rows roll back separately).
        for segment, start, end in zip(attention.segments, offsets, offsets[1:], strict=False):
            cache.trim(segment.row)
            output = self.model(
                input_ids=tokens[None, start:end], position_ids=positions[None, start:end],
                past_key_values=cache.inner[segment.row], use_cache=True, output_hidden_states=bool(hidden_layers),
            )
            cache.stored[segment.row] += segment.count
            logits.append(output.logits[0])
            if hidden_layers:  # hidden_states[0] is the embedding: layer i's output is hidden_states[i + 1]
                hidden.append(torch.cat([output.hidden_states[index + 1][0] for index in hidden_layers], dim=-1))
        return ForwardOutput(torch.cat(logits) if want_logits else None, torch.cat(hidden) if hidden_layers else None)
