"""Two compiled kernel libraries, the same bits? Runs every compiled call (the int4 and w8a32
matmuls, norm + q/k/v + RoPE, a draft head's q/k/v, attention over per-query lists and over a chain,
the MLP call, the final norm and head, and whole forwards through the stack in one call) on the
same random inputs through library A and library B: every layer variant the load-time check runs
(specdec.models.fused_layer.CHECKED_VARIANTS), float32, bfloat16 and float16 caches, blocks of 1 to
200 rows, contexts up to 300 slots; prints how many outputs differ (0: a refactor changed no bit).

Build a revision's library as kernel_library_ab.py says (its sources and headers), then
    python benchmarks/cpu/kernel_bits_ab.py old.so [new.so]     (default B: this tree's, built here)
with ATEN_CPU_CAPABILITY=avx2 or default (and -march=x86-64-v3 / x86-64 for A) for the other paths.
"""

import ctypes
import sys

import torch

import specdec.models.layer_stack as layer_stack
import specdec.models.native as native
from specdec.models.attention import query_list
from specdec.models.base import Attention, Segment
from specdec.models.fused_layer import (
    CHECKED_VARIANTS,
    attend_chain,
    attend_queries,
    head_qkv_projection,
    mlp_block,
    norm_then_linear,
    qkv_projection,
    random_layers,
)
from specdec.models.int4 import Int4Linear
from specdec.models.w8a32 import W8A32Linear


def layer_outputs(format: int) -> list[torch.Tensor]:
    packed = Int4Linear if format == 4 else W8A32Linear
    results = []
    for variant in CHECKED_VARIANTS.values():
        generator = torch.Generator().manual_seed(1)
        reference, layer = random_layers(generator, packed, **variant)
        torch.manual_seed(3)
        head_linear = packed.of(torch.nn.Linear(128, 128))
        for kv_dtype in (torch.float32, torch.bfloat16, torch.float16):
            for block, context in ((1, 5), (3, 21), (20, 300), (200, 40)):
                x = torch.randn(block, 64, generator=generator) * 2
                frequencies = torch.rand(reference.rotary // 2, generator=generator)
                angles = torch.arange(context, context + block)[:, None] * frequencies[None]
                cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
                qkv = qkv_projection(layer, x, cos, sin)
                q, k, v = qkv.transpose(0, 1).split([4, 2, 2])
                keys = torch.randn(2, 2, context + block + 8, 16, generator=generator).to(kv_dtype)
                values = torch.randn(2, 2, context + block + 8, 16, generator=generator).to(kv_dtype)
                lists = query_list(list(range(block)), [i % 2 for i in range(block)],
                                   [torch.arange(context + i + 1) for i in range(block)])
                listed_keys, listed_values, listed = keys.clone(), values.clone(), torch.zeros(block, 4, 16)
                attend_queries(layer, q, k, v, lists, listed_keys, listed_values, listed)
                chain_keys, chain_values, chain = keys.clone(), values.clone(), torch.zeros(block, 4, 16)
                attend_chain(layer, q, k, v, 0, block, context, torch.arange(context + block), chain_keys,
                             chain_values, chain, keys.stride(0))
                norm = next(n for n in (layer.input_norm, layer.post_attention_norm, layer.attention_out_norm)
                            if n is not None)
                results += [qkv, listed_keys, listed_values, listed, chain_keys, chain_values, chain,
                            mlp_block(layer, x, listed.reshape(block, -1)),
                            norm_then_linear(norm, layer.gate_up_proj, x)]
                if reference.rotary == 16:
                    results.append(head_qkv_projection(head_linear, norm, norm, x, x * 0.5, cos, sin, 6, 16))
    return results


def forward_outputs(format: int) -> list[torch.Tensor]:
    """layer_stack.check_stack's model: forwards through the stack in one call (and its layers)."""
    results = []
    for seed in (0, 1):
        network = layer_stack._random_network(torch.Generator().manual_seed(seed), format)
        for kv_dtype in (torch.float32, torch.bfloat16, torch.float16):
            network.kv_dtype = kv_dtype
            cache = network.new_cache(rows=2)
            steps = [([5, 9, 14, 3, 27, 8, 19, 40, 2] * 3, [0] * 27, Attention.chain(27, 0), ()),
                     ([7, 3, 30], [0] * 3, Attention.chain(3, 0), (0, 2)),
                     ([12, 4, 4, 31, 6, 11], [1] * 4 + [0] * 2, Attention((Segment(1, 4), Segment(0, 2))), (1,))]
            for tokens, rows, attention, hidden_layers in steps:
                positions = torch.tensor([int(cache.lengths[row]) + rows[:index].count(row)
                                          for index, row in enumerate(rows)])
                output = network(torch.tensor(tokens), positions, cache, attention, hidden_layers=hidden_layers)
                results += [output.logits] + ([] if output.hidden is None else [output.hidden])
                for segment in attention.segments:
                    cache.commit(segment.row, segment.count)
    return results


def outputs(handle: ctypes.CDLL) -> list[torch.Tensor]:
    native.library = lambda: handle  # every compiled call reads it
    return [t for format in (4, 8) for t in layer_outputs(format) + forward_outputs(format)]


def main() -> None:
    first = native.declare(ctypes.CDLL(sys.argv[1]))
    second = native.declare(ctypes.CDLL(sys.argv[2])) if len(sys.argv) > 2 else native.library()
    print(f"A: {sys.argv[1]} ({first.specdec_int4_isa().decode()}, {first.specdec_w8a32_isa().decode()}); "
          f"B: {second._name} ({second.specdec_int4_isa().decode()}, {second.specdec_w8a32_isa().decode()})")
    a, b = outputs(first), outputs(second)
    differing = [index for index, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)]
    print(f"{len(a)} outputs compared, {len(differing)} differ" + (f" (first: {differing[:8]})" if differing else ""))
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
