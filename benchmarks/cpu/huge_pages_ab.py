"""Packed weights in 2 MB pages (specdec/models/huge_pages.py, what loading does) against the same
bytes in ordinary 4 KB pages (a copy advised MADV_NOHUGEPAGE) and, where the model's packed-store entry
is there, as memory-mapped from its files (what loading gave before), in one process: rounds interleaving the read probe
(roofline_probe.cpp, itself in 2 MB pages), every packed linear alone with one row, and T(1) after
64 cached tokens, each placement in turn. Medians, and the process's AnonHugePages (what the kernel
actually granted).

    python benchmarks/cpu/huge_pages_ab.py MODEL_DIR [--quantize int4] [--rounds 9]
        [--out runs/huge_pages_ab.json]
"""

import argparse
import statistics
from pathlib import Path

import torch
from roofline import probe  # (this folder: the script's own path comes first)
from streaming_split import split_line, time_linears

from specdec.machine import write_measurement
from specdec.models.fused_layer import FusedDecoderLayer
from specdec.models.huge_pages import into_huge_pages
from specdec.models.int4 import PackedLinear
from specdec.models.layer_stack import LayerStack
from specdec.models.loading import load
from specdec.models.packed_store import entries
from specdec.models.timing import prefilled_cache, time_block


def anon_huge_kb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def stored_records(prefix: str, paths: list[str]) -> list[torch.Tensor] | None:
    """The records of the newest packed-store entry named ``prefix``..., memory-mapped as safetensors maps them."""
    from safetensors import safe_open

    folders = sorted((entry.folder for entry in entries() if entry.folder.name.startswith(prefix)),
                     key=lambda folder: folder.stat().st_mtime)
    if not folders:
        return None
    tensors: dict[str, torch.Tensor] = {}
    for file in folders[-1].glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update((name, handle.get_tensor(name)) for name in handle.keys() if name.endswith(".records"))
    return [tensors[f"{path}.records"] for path in paths]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quantize", default="int4", choices=["int4", "w8a32"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default="runs/huge_pages_ab.json")
    args = parser.parse_args()
    model = load(args.model, quantize=args.quantize)
    network = model.network
    named = {path: module for path, module in network.named_modules() if isinstance(module, PackedLinear)}
    linears = list(named.values())
    rows = [torch.randn(1, linear.in_features) for linear in linears]
    weight_bytes = sum(linear.records.numel() for linear in linears)
    placements = {"4 KB pages": into_huge_pages([linear.records for linear in linears], huge=False),
                  "2 MB pages": into_huge_pages([linear.records for linear in linears])}
    stored = stored_records(f"{Path(args.model).name}-{args.quantize}-", list(named))
    if stored is not None:  # what loading read from before: the store's files, memory-mapped
        placements["mapped store files"] = stored
    print(f"AnonHugePages with both placements resident: {anon_huge_kb() / 1024:.0f} MiB "
          f"(the weights: {weight_bytes / 2**20:.0f} MiB)")
    handle, cache = probe(), prefilled_cache(model)

    def place(records: list[torch.Tensor]) -> None:
        for linear, tensor in zip(linears, records, strict=True):
            linear.records = tensor
        if network.layer_stack is not None:  # it holds the records' addresses
            network.layer_stack = LayerStack([layer for layer in network.layers
                                              if isinstance(layer, FusedDecoderLayer)], network.rope_index)

    linear_ms: dict[str, list[float]] = {name: [] for name in placements}
    forward_ms: dict[str, list[float]] = {name: [] for name in placements}
    read_gbs = []
    for round_index in range(args.rounds + 1):  # the first round warms up
        read_gbs.append(handle.specdec_probe_read_gbs(1 << 30, 2))
        for name, records in placements.items():
            place(records)
            linear_ms[name].append(min(time_linears(linears, rows) for _ in range(2)) * 1e3)
            forward_ms[name].append(time_block(model, cache, 1, 3) * 1e3)
        if round_index == 0:
            read_gbs.clear()
            for values in (*linear_ms.values(), *forward_ms.values()):
                values.clear()
    gbs = statistics.median(read_gbs)
    print(f"{len(linears)} packed linears, {weight_bytes / 1e9:.3f} GB; probe {gbs:.1f} GB/s (median of {args.rounds})")
    for name in placements:
        print(f"{name}: {split_line(weight_bytes, linear_ms[name], forward_ms[name], gbs)}")
    path = write_measurement(args.out, {"model": args.model, "quantize": args.quantize, "weight_bytes": weight_bytes,
                                        "read_gbs": read_gbs, "linear_ms": linear_ms, "forward_ms": forward_ms})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
