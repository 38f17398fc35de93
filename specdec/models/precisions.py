"""One entry to the CPU precisions that replace a model's linears: int8 (quantize.py), int4
(int4.py) and w8a32 (w8a32.py). Its own module so that none of those imports another's
quantizer (the package has no import cycles)."""

from __future__ import annotations

from torch import nn

from specdec.models.int4 import quantize_int4
from specdec.models.quantize import quantize_int8
from specdec.models.w8a32 import quantize_w8a32


def quantize_linears(module: nn.Module, kind: str) -> nn.Module:
    """quantize_int4 for kind "int4", quantize_w8a32 for "w8a32" (int8 where their kernel cannot run
    here), else quantize_int8; `module.quantized` says which ran."""
    return {"int4": quantize_int4, "w8a32": quantize_w8a32}.get(kind, quantize_int8)(module)
