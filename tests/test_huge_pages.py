"""Packed weights moved into 2 MB pages: the same bits, laid out for the kernels, and (where Linux
grants transparent huge pages) actually in huge pages."""

from pathlib import Path

import pytest
import torch

from specdec.models.huge_pages import ALIGN, HUGE_PAGE, huge_pages_advised, into_huge_pages
from specdec.models.int4 import PackedLinear


def anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_copies_hold_the_same_bits_each_on_a_cache_line() -> None:
    tensors = [torch.randint(0, 256, (37, 48), dtype=torch.uint8), torch.randn(5, 3),
               torch.arange(11, dtype=torch.int64)]
    copies = into_huge_pages(tensors)
    for tensor, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape and torch.equal(copy, tensor)
        assert copy.data_ptr() != tensor.data_ptr()
        assert copy.data_ptr() % ALIGN == 0
    if huge_pages_advised():
        assert copies[0].data_ptr() % HUGE_PAGE == 0
    del tensors
    assert int(copies[1].sum().isfinite())  # the copies keep their mapping alive on their own


def test_nothing_to_move() -> None:
    assert into_huge_pages([]) == []


def thp_setting() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.is_file():
        return None
    return path.read_text().split("[")[1].split("]")[0]


@pytest.mark.skipif(thp_setting() not in {"always", "madvise"} or not huge_pages_advised()
                    or not Path("/proc/self/smaps_rollup").is_file(),
                    reason="this OS grants no transparent huge pages")
def test_a_large_copy_lands_in_huge_pages() -> None:
    before = anon_huge_kb()
    copies = into_huge_pages([torch.ones(8 * HUGE_PAGE, dtype=torch.uint8)])
    # At least one of the eight: a fragmented host may grant fewer than all.
    assert anon_huge_kb() - before >= HUGE_PAGE // 1024, "the kernel granted no 2 MB page to an advised mapping"
    assert int(copies[0][-1]) == 1


def test_a_packed_model_reads_its_records_from_the_arena(wide_model_dir) -> None:
    from specdec.models.loading import load

    model = load(str(wide_model_dir), quantize="int4")
    linears = [module for module in model.network.modules() if isinstance(module, PackedLinear)]
    assert linears
    pointers = sorted(linear.records.data_ptr() for linear in linears)
    if huge_pages_advised():
        assert pointers[0] % HUGE_PAGE == 0  # one arena, carved in order
    assert all(pointer % ALIGN == 0 for pointer in pointers)
