"""A head's data as the parts it was saved in, read a sequence at a time when a batch asks for it.

Why: the features are ~6 KB a token (float8: three feature layers and the final state of a 1.5B
target; 12 KB in the float16 parts saved before), so a few million tokens are tens of gigabytes:
more than the RAM of the machines that make them. The parts stay on disk (safetensors,
memory-mapped); only the token ids, which the draft vocabulary is counted from, are read whole.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.training.head_data import HeadFeatures


class FeatureParts:
    """The sequences of ``paths`` (saved HeadFeatures), in order, as one data set."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = list(paths)
        self._files = [safe_open(str(path), framework="pt") for path in self.paths]
        sizes = [handle.get_slice("tokens").get_shape()[0] for handle in self._files]
        self._starts = [0, *itertools.accumulate(sizes)][:-1]  # each part's first sequence
        self._count = sum(sizes)
        self.tokens = (torch.cat([handle.get_tensor("tokens") for handle in self._files])  # [N, S] int64
                       if self._files else torch.empty(0, 0, dtype=torch.long))

    def __len__(self) -> int:
        return self._count

    def select(self, rows: torch.Tensor | slice) -> HeadFeatures:
        """These sequences (an index tensor or a slice), read from their parts."""
        indices = torch.arange(self._count)[rows] if isinstance(rows, slice) else rows
        rows_read: list[HeadFeatures] = []
        for index in indices.tolist():
            part = bisect.bisect_right(self._starts, index) - 1
            local = index - self._starts[part]
            handle = self._files[part]
            rows_read.append(HeadFeatures.from_stored({name: handle.get_slice(name)[local : local + 1]
                                                       for name in handle.keys()}))
        if not rows_read:
            raise ValueError("no sequences selected")
        return HeadFeatures.cat(rows_read)

    def whole(self) -> HeadFeatures:
        """Every sequence in memory (held-out sets, tests)."""
        return self.select(slice(None))
