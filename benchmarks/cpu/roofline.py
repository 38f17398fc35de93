"""A roofline for this machine: how close each verify block T(k) is to what the CPU allows.

Two ceilings are measured here (roofline_probe.cpp, compiled for this CPU as the int4 kernel is):
the memory read bandwidth over a buffer far larger than the last-level cache, and the peak of
the 8-bit dot-product instruction the int4 kernel multiplies with (AVX-512 VNNI vpdpbusd, AVX2
vpmaddubsw). Then, for each precision of the target, T(k) (median of k-token forwards after 64
cached tokens) beside its bound: max(weight bytes / bandwidth, k x multiply-adds / peak). A
fraction near 1 means the kernel is at the machine's limit; ATEN_CPU_CAPABILITY=avx2 shows what
an AVX2-only CPU gets (the probe and the kernel both follow it). The bandwidth is probed again
beside each T(k) and each fraction taken against the bandwidth read next to it (the median over
the rounds): a shared VM's bandwidth drifts by a third within minutes, and a bound read once at
the start put T(1) anywhere from 0.75 to 1.1 of it.

    python benchmarks/cpu/roofline.py MODEL_DIR [--configs int4 int8] [--blocks 1,2,4,8,12,16]
        [--repeats 5] [--out runs/roofline.json]
"""

import argparse
import ctypes
import gc
import hashlib
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import nn

from specdec.bench.suite import machine_description
from specdec.machine import write_measurement
from specdec.models import native
from specdec.models.loading import load
from specdec.models.timing import prefilled_cache, time_block

PROBE = Path(__file__).with_name("roofline_probe.cpp")
CONFIGS = {"int4": dict(quantize="int4"), "int8": dict(quantize="int8"), "w8a32": dict(quantize="w8a32"),
           "float32": dict()}
INTEGER_DOT = {"int4", "int8"}  # precisions whose matmuls run on the probed 8-bit dot instruction


def probe() -> ctypes.CDLL:
    """The probe compiled with the kernels' flags (so ATEN_CPU_CAPABILITY caps both alike)."""
    flags = [*native.compiler_flags(), str(PROBE)]
    key = hashlib.sha256(PROBE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    library = Path(tempfile.gettempdir()) / f"specdec-roofline-{key}.so"
    if not library.is_file():
        subprocess.run(["g++", *flags, "-o", str(library)], check=True)
    handle = ctypes.CDLL(str(library))
    handle.specdec_probe_isa.restype = ctypes.c_char_p
    handle.specdec_probe_read_gbs.restype = handle.specdec_probe_dot_gmacs.restype = ctypes.c_double
    handle.specdec_probe_read_gbs.argtypes = handle.specdec_probe_dot_gmacs.argtypes = [ctypes.c_int64, ctypes.c_int]
    return handle


def streamed_bytes(network: nn.Module) -> int:
    """Bytes a forward reads whatever its length: every parameter and buffer but the tables of
    which a block reads only its k rows (the embedding, the rotary cos / sin by position)."""
    skipped = {id(t) for m in network.modules() if isinstance(m, nn.Embedding) for t in m.parameters()}
    skipped |= {id(t) for name, t in network.named_buffers() if name.split(".")[-1] in ("rope_cos", "rope_sin")}
    tensors = {id(t): t for t in [*network.parameters(), *network.buffers()] if id(t) not in skipped}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def multiply_adds(network: nn.Module) -> int:
    """Multiply-adds per token in the linear layers (attention over 64 keys is negligible beside them)."""
    return sum(m.in_features * m.out_features for m in network.modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features") and not isinstance(m, nn.Embedding))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--configs", nargs="+", default=["int4"], choices=list(CONFIGS))
    parser.add_argument("--blocks", default="1,2,3,4,5,6,8,10,12,16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="passes over the blocks (medians over them)")
    parser.add_argument("--out", default="runs/roofline.json")
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    handle = probe()
    bandwidth = handle.specdec_probe_read_gbs(1 << 30, 5)  # GB/s
    peak = handle.specdec_probe_dot_gmacs(300_000_000 // max(torch.get_num_threads(), 1), 3)  # G MAC/s
    isa = handle.specdec_probe_isa().decode()
    print(f"{machine_description()}; read bandwidth {bandwidth:.1f} GB/s; {isa} peak {peak:.0f} G multiply-adds/s")
    rows = []
    for name in args.configs:
        model = load(args.model, **CONFIGS[name])
        network = model.network
        weight_bytes, macs = streamed_bytes(network), multiply_adds(network)
        cache = prefilled_cache(model, 1, 64)
        time_block(model, cache, 1, 2)  # warm-up
        samples: dict[int, list[float]] = {k: [] for k in blocks}
        beside: dict[int, list[float]] = {k: [] for k in blocks}  # the read bandwidth probed next to each sample
        for _ in range(args.rounds):  # interleaved: the machine's drift touches every k alike
            for k in blocks:
                beside[k].append(handle.specdec_probe_read_gbs(1 << 30, 2))
                samples[k].append(time_block(model, cache, k, args.repeats) * 1e3)
        times = {k: statistics.median(values) for k, values in samples.items()}
        bandwidth = statistics.median([gbs for values in beside.values() for gbs in values])
        memory_ms = weight_bytes / (bandwidth * 1e9) * 1e3
        print(f"\n{name}: {weight_bytes / 1e9:.2f} GB streamed a forward ({memory_ms:.1f} ms at {bandwidth:.0f} GB/s, "
              f"the median read beside the blocks), "
              f"{macs / 1e9:.2f} G multiply-adds a token")
        print(f"{'k':>3} {'T(k) ms':>8} {'T(k)/T(1)':>9} {'memory ms':>9} {'compute ms':>10} {'bound/T':>7}")
        table = []
        for k in blocks:
            compute_ms = k * macs / (peak * 1e9) * 1e3 if name in INTEGER_DOT else None
            fraction = statistics.median(max(weight_bytes / (gbs * 1e9) * 1e3, compute_ms or 0.0) / ms
                                         for gbs, ms in zip(beside[k], samples[k], strict=True))
            table.append({"k": k, "ms": times[k], "ratio": times[k] / times[blocks[0]], "memory_ms": memory_ms,
                          "compute_ms": compute_ms, "fraction_of_bound": fraction,
                          "read_gbs_beside": beside[k], "ms_samples": samples[k]})
            compute = f"{compute_ms:10.1f}" if compute_ms is not None else f"{'-':>10}"
            print(f"{k:3d} {times[k]:8.1f} {times[k] / times[blocks[0]]:9.2f} {memory_ms:9.1f} {compute} "
                  f"{fraction:7.2f}")
        rows.append({"config": name, "read_gbs": bandwidth, "weight_bytes": weight_bytes,
                     "multiply_adds_per_token": macs,
                     "notice": getattr(network, "quantize_notice", None), "blocks": table})
        del model, network, cache
        gc.collect()
    path = write_measurement(args.out, {"machine": machine_description(), "model": args.model,
                                        "read_gbs": bandwidth, "dot_isa": isa, "dot_peak_gmacs": peak, "rows": rows})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
