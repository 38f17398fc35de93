"""Packed weights moved into 2 MB pages. A token's forward streams every weight byte once; with
4 KB pages that is a TLB miss every 64 cache lines, and the int4 linears of the 1.5B read 12% faster
from transparent huge pages on a Zen 4 VM (benchmarks/cpu/huge_pages_ab.py). The memory is an
anonymous private mapping advised MADV_HUGEPAGE before it is first touched, as Linux's default THP
setting ("madvise") asks; where the kernel, the setting or the OS grants no huge pages, the same
bytes sit in ordinary pages and nothing else changes."""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line, as the kernels' loads expect


def huge_pages_advised() -> bool:
    """Whether this OS lets a mapping ask for transparent huge pages."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def into_huge_pages(tensors: Sequence[torch.Tensor], huge: bool = True) -> list[torch.Tensor]:
    """Copies of ``tensors`` (contiguous, any dtype) carved from one mapping advised to use 2 MB pages
    (``huge=False``: advised not to, for comparisons); the copies keep the mapping alive. Without the
    advice (another OS) the tensors come back as they are."""
    if not tensors or not huge_pages_advised():
        return list(tensors)
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Before the first touch: the faults then take whole 2 MB pages.
    mapping.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    arena = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping as long as any copy lives
    start = -arena.data_ptr() % HUGE_PAGE
    copies = []
    for tensor, offset in zip(tensors, offsets, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        piece = arena[start + offset:start + offset + nbytes].view(tensor.dtype).view(tensor.shape)
        piece.copy_(tensor)
        copies.append(piece)
    return copies
