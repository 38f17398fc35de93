"""int8 weights on CPU: dynamically quantized linears (fbgemm).

Measured on the project's 2-core EPYC (DESIGN.md): one-token decoding of a 277M stack runs at
the memory-bandwidth limit in int8 (12.6 ms vs 57 ms fp32), and verifying 8 tokens costs only
~1.2x one token, where fp32 costs ~3x. That makes int8 the right default shape for speculative
decoding on CPU.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def quantize_int8(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear with a dynamically quantized int8 linear, in place."""
    from torch.ao.quantization import quantize_dynamic

    if next(module.parameters()).device.type != "cpu":
        raise ValueError("int8 quantization runs on CPU only (fbgemm); use --device cpu or drop --quantize")
    with warnings.catch_warnings():
        # torch marks its quantized tensor constructors deprecated; they are what fbgemm runs.
        warnings.simplefilter("ignore")
        return quantize_dynamic(module.float(), {nn.Linear}, dtype=torch.qint8, inplace=True)
