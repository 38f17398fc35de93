"""One entry to the CPU precisions that replace a model's linears: int8 (quantize.py), int4
(int4.py) and w8a32 (w8a32.py), and for the own forward, the compiled layer that packed linears
run in (fused_layer.py). Its own module so that none of those imports another's quantizer and
the model (transformer.py) knows none of them (the package has no import cycles)."""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.fused_layer import fuse
from specdec.models.int4 import quantize_int4
from specdec.models.quantize import quantize_int8
from specdec.models.transformer import LlamaFamilyModel
from specdec.models.w8a32 import quantize_w8a32

PACKED_FORMATS = {"int4": 4, "w8a32": 8}  # the precisions whose linears the compiled layer reads


def quantize_linears(module: nn.Module, kind: str) -> nn.Module:
    """quantize_int4 for kind "int4", quantize_w8a32 for "w8a32" (int8 where their kernel cannot run
    here), else quantize_int8; `module.quantized` says which ran."""
    return {"int4": quantize_int4, "w8a32": quantize_w8a32}.get(kind, quantize_int8)(module)


def quantize_model(network: LlamaFamilyModel, kind: str = "int8") -> LlamaFamilyModel:
    """int8 linears (or 4-bit: "int4"; 8-bit groups with float32 activations: "w8a32"), and
    per-row attention after the prefill, so that a token is scored bit-for-bit the same inside a
    verify block as alone (the greedy-equality invariant). `network.quantized` then says which ran
    ("int8" where int4 or w8a32 could not). Packed linears run in the compiled layer
    (FusedDecoderLayer) where it passes its self-check here; the notice says whether they do."""
    quantize_linears(network, kind)
    network.fixed_rows = None  # each row's products are computed alone in any blocking
    packed = PACKED_FORMATS.get(str(network.quantized))
    if packed is not None:
        problem = fuse(network, packed)
        sixteen_bits = problem is None
        if sixteen_bits:
            # Keys and values stored in float16, read by the compiled attention in float32: half the
            # cache's bytes (as llama.cpp's default f16 cache) and of what a long context's step
            # reads, the same bits for target-only and speculative decoding; load(kv_dtype="float32")
            # keeps them in 32. float16, not bfloat16: its 8-bit mantissa cost HumanEval problems that
            # float16 did not (int4, measured in docs/design.md). w8a32 too: the default SmolLM2's
            # greedy text was the float32 cache's on 24 of 24 bundled prompts x 128 tokens.
            network.kv_dtype = torch.float16
        network.quantize_notice = f"{network.quantize_notice}; " + (
            f"layer ops not compiled ({problem})" if problem else "layer ops compiled"
            + (", keys and values in float16" if sixteen_bits else ""))
    return network
