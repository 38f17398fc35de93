"""The int8 linear's kernels: the prepacked oneDNN path returns the same floats as `_int_mm`, and
every row of a block equals that row alone (the batch invariance greedy equality rests on)."""

import pytest
import torch

from specdec.models import quantize


def _linear_pair(monkeypatch, weight: torch.Tensor, bias: bool):
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias)
    linear.weight.data.copy_(weight)
    packed = quantize.Int8Linear(linear)
    monkeypatch.setattr(quantize, "PACKED_KERNEL_AVAILABLE", False)
    plain = quantize.Int8Linear(linear)
    return packed, plain


@pytest.mark.skipif(not quantize.PACKED_KERNEL_AVAILABLE, reason="this torch has no oneDNN qlinear op")
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_packed_kernel_equals_int_mm_and_is_row_invariant(monkeypatch, rows):
    monkeypatch.setattr(quantize, "PACKED_MIN_WEIGHTS", 0)  # this small matrix would keep _int_mm
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=generator)
    weight[0] = 1.0  # a saturated channel: products past 2**24 round the same way in both kernels
    packed, plain = _linear_pair(monkeypatch, weight, bias=True)
    assert packed.packed and not plain.packed
    x = torch.randn(rows, 160, generator=generator) * 4
    x[0] = 1.0
    out = packed(x)
    assert torch.equal(out, plain(x))
    assert torch.equal(torch.cat([packed(x[i:i + 1]) for i in range(rows)]), out)


def test_fallback_kernel_is_row_invariant(monkeypatch):
    _, plain = _linear_pair(monkeypatch, torch.randn(32, 48), bias=False)
    x = torch.randn(7, 48)
    assert torch.equal(torch.cat([plain(x[i:i + 1]) for i in range(7)]), plain(x))
