"""One entry to the CPU precisions that replace a model's linears: int8 (quantize.py), int4
(int4.py) and w8a32 (w8a32.py), and for the own forward, the compiled layer that packed linears
run in (fused_layer.py). Its own module so that none of those imports another's quantizer and
the model (transformer.py) knows none of them (the package has no import cycles).

A Packer decides once, from all of a model's weight shapes, what its linears become here (the
asked kernel where it passes its self-check on every shape, int8 where it cannot run), then packs
the model part by part: building.build_lean hands it each layer as it is read, so only one layer's
float32 weights exist beside the packed ones, and packed_store writes each packed part to disk."""

from __future__ import annotations

import torch
from torch import nn

import specdec.models.fused_layer as fused_layer
import specdec.models.int4 as int4
import specdec.models.layer_stack as layer_stack
import specdec.models.w8a32 as w8a32
from specdec.models.fused_layer import FusedDecoderLayer, FusedOutput, packed_format
from specdec.models.huge_pages import into_huge_pages
from specdec.models.int4 import GROUP, Int4Linear, PackedLinear, checked_shapes
from specdec.models.layer_stack import LayerStack
from specdec.models.quantize import KERNELS, Int8Linear, int8_parts
from specdec.models.transformer import DecoderLayer, LlamaFamilyModel
from specdec.models.w8a32 import W8A32Linear

PACKED_LINEARS: dict[str, type[PackedLinear]] = {"int4": Int4Linear, "w8a32": W8A32Linear}
PACKED_FORMATS = {"int4": 4, "w8a32": 8}  # the precisions whose linears the compiled layer reads


def linear_shapes(module: nn.Module) -> set[tuple[int, int]]:
    """(out, in) of every nn.Linear in ``module`` (a model on the meta device answers too)."""
    return {(child.out_features, child.in_features) for child in module.modules() if isinstance(child, nn.Linear)}


class Packer:
    """What a model's linears become in precision ``asked`` on this CPU, and the packing itself.
    ``runs`` is what they become: ``asked``, or int8 where its kernel cannot run here (``problem``
    says why). Linears whose inputs are not a multiple of 32 become int8 in every precision."""

    def __init__(self, asked: str, shapes: set[tuple[int, int]]) -> None:
        kind = PACKED_LINEARS.get(asked)
        self.asked = asked
        self.fitting = {shape for shape in shapes if shape[1] % GROUP == 0}
        check = {"int4": lambda out, inputs: int4.check_kernel(out, inputs),
                 "w8a32": lambda out, inputs: w8a32.check_kernel(out, inputs)}.get(asked)
        self.problem = None if kind is None else checked_shapes(self.fitting, KERNELS.on_check, check, asked)
        self.packed = kind if self.problem is None else None
        self.runs = asked if self.packed is not None else "int8"
        # Why layers do not run compiled (None: they do): checked once, where packed linears run.
        self.layer_problem = fused_layer.layer_problem(self.packed.format) if self.packed is not None else None
        self.int8_linears = 0
        self.groups = self.exact_groups = 0
        # The plain int8 weight of each Int8Linear packed here (its buffer is in the kernel's layout,
        # which may not be a plain tensor): what packed_store writes in its place.
        self.plain_int8: dict[Int8Linear, torch.Tensor] = {}

    @property
    def format(self) -> int | None:
        """The packed layout the linears take (4: int4, 8: w8a32), None where they are int8."""
        return None if self.packed is None else self.packed.format

    @classmethod
    def for_module(cls, module: nn.Module, asked: str) -> Packer:
        return cls(asked, linear_shapes(module))

    def linear(self, linear: nn.Linear) -> nn.Module:
        """``linear`` in this precision (its weight read once, in float32)."""
        if linear.weight.device.type != "cpu":
            raise ValueError(f"{self.asked} runs on CPU only; use --device cpu or drop --quantize")
        if self.packed is not None and PackedLinear.fits(linear):
            packed = self.packed.of(linear)
            if packed.exact_groups is not None:
                self.groups += linear.out_features * linear.in_features // GROUP
                self.exact_groups += packed.exact_groups
            return packed
        self.int8_linears += 1
        weight_int8, scale = int8_parts(linear.weight)
        module = Int8Linear(weight_int8, scale, linear.bias)
        self.plain_int8[module] = weight_int8
        return module

    def pack(self, module: nn.Module) -> nn.Module:
        """``module`` with every nn.Linear in it replaced (in place; a linear itself: its
        replacement), and a DecoderLayer whose linears are packed swapped for its compiled form
        where that passed its self-check here."""
        if isinstance(module, nn.Linear):
            return self.linear(module)
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, self.linear(child))
        if isinstance(module, DecoderLayer) and self.packed is not None and self.layer_problem is None and \
                packed_format(module) == self.packed.format:
            return FusedDecoderLayer(module)
        return module

    def notice(self) -> str | None:
        """The one line the CLI prints about the linears (None for int8 asked: kernel_notice says)."""
        if self.asked == "int8":
            return None
        if self.problem is not None:
            return f"{self.asked} kernel not used ({self.problem}): int8 weights instead"
        kernel = int4 if self.asked == "int4" else w8a32
        line = f"{self.asked} kernel on this CPU: {kernel.kernel_isa()}, "
        if self.asked == "int4":
            line += f"checked bit for bit on {len(self.fitting)} weight shapes"
        else:
            held = self.exact_groups / max(self.groups, 1)
            line += (f"float32 activations, checked on {len(self.fitting)} weight shapes; "
                     f"{held:.1%} of weight groups held exactly (4- or 8-bit groups)")
        if self.int8_linears:
            line += f"; {self.int8_linears} linears with inputs not a multiple of {GROUP} stay int8"
        return line

    def finish(self, module: nn.Module) -> None:
        """Say on ``module`` what ran (``quantized``, ``quantize_notice``); for the own forward,
        per-row products (no fixed-row blocking), the final norm and head in one compiled call and
        a float16 cache where its layers run compiled."""
        # setattr (B010 is wrong here): nn.Module's __setattr__ types its values as Tensor | Module, these are str.
        setattr(module, "quantized", self.runs)  # noqa: B010 - what LanguageModel.precision reports
        setattr(module, "quantize_notice", self.notice())  # noqa: B010 - the one line the CLI prints
        if isinstance(module, LlamaFamilyModel):
            finish_network(module, self.layer_problem)


def move_into_huge_pages(network: nn.Module) -> None:
    """Every packed linear's records copied into 2 MB pages (huge_pages.py), before anything holds
    their addresses (the one-call stack takes them once)."""
    linears = [module for module in network.modules() if isinstance(module, PackedLinear)]
    for linear, records in zip(linears, into_huge_pages([linear.records for linear in linears]), strict=True):
        linear.records = records


def finish_network(network: LlamaFamilyModel, layer_problem: str | None) -> None:
    """What a packed own forward runs besides its layers (Packer.finish; packed_store after a load):
    ``layer_problem`` is why its layers do not run compiled (None: they do)."""
    network.fixed_rows = None  # each row's products are computed alone in any blocking
    format = PACKED_FORMATS.get(str(network.quantized))
    if format is None:
        return
    move_into_huge_pages(network)
    stack_problem: str | None = None  # why the layers are not called in one call, where they run compiled
    if layer_problem is None:
        head = network.lm_head
        if isinstance(network.layers[0], FusedDecoderLayer) and isinstance(head, PackedLinear) and \
                head.format == format:
            network.norm_then_head = FusedOutput(network.norm, head)
        fused = [layer for layer in network.layers if isinstance(layer, FusedDecoderLayer)]
        stack_problem = layer_stack.stack_problem(format) if len(fused) == len(network.layers) else None
        if len(fused) == len(network.layers) and stack_problem is None:
            network.layer_stack = LayerStack(fused, network.rope_index)
        # Keys and values stored in float16, read by the compiled attention in float32: half the
        # cache's bytes (as llama.cpp's default f16 cache) and of what a long context's step
        # reads, the same bits for target-only and speculative decoding; load(kv_dtype="float32")
        # keeps them in 32. float16, not bfloat16: its 8-bit mantissa cost HumanEval problems that
        # float16 did not (int4, measured in docs/design.md). w8a32 too: the default SmolLM2's
        # greedy text was the float32 cache's on 24 of 24 bundled prompts x 128 tokens.
        network.kv_dtype = torch.float16
    compiled = f"layer ops not compiled ({layer_problem})" if layer_problem else \
        "layer ops compiled, keys and values in float16"
    if layer_problem is None and stack_problem is not None:
        compiled += f"; layers called one by one (the one-call stack failed its check: {stack_problem})"
    network.quantize_notice = f"{network.quantize_notice}; {compiled}"


def quantize_linears(module: nn.Module, kind: str) -> nn.Module:
    """Every nn.Linear of ``module`` in precision ``kind`` ("int4", "w8a32": int8 where their kernel
    cannot run here; "int8"), in place; `module.quantized` says which ran."""
    packer = Packer.for_module(module, kind)
    module.float()
    packer.pack(module)
    packer.finish(module)
    return module


def quantize_model(network: LlamaFamilyModel, kind: str = "int8") -> LlamaFamilyModel:
    """int8 linears (or 4-bit: "int4"; 8-bit groups with float32 activations: "w8a32"), and
    per-row attention after the prefill, so that a token is scored bit-for-bit the same inside a
    verify block as alone (the greedy-equality invariant). `network.quantized` then says which ran
    ("int8" where int4 or w8a32 could not). Packed linears run in the compiled layer
    (FusedDecoderLayer) where it passes its self-check here; the notice says whether they do."""
    packer = Packer.for_module(network, kind)
    network.float()
    for index, layer in enumerate(network.layers):
        network.layers[index] = packer.pack(layer)
    network.lm_head = packer.pack(network.lm_head)
    packer.finish(network)
    return network
