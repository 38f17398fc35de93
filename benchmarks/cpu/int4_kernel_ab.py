"""A/B of the int4 kernel's source: a git revision's int4_matmul.cpp against the working tree's, both
compiled with the flags specdec uses on this machine, in one process, interleaved call by call; the
linears of Qwen2.5-Coder-1.5B layers (fused gate/up, down, fused q/k/v, o: 47M random weights,
29 MB of records a layer in 2 MB pages; 4 layers by default, more than a 2-core VM's L3) for each block size; the
best of 7 per source. Both kernels' outputs are compared: equal bits, or the largest difference.

    python benchmarks/cpu/int4_kernel_ab.py [--base REV | --base-file FILE.cpp] [--rows 1,2,4,8,12,16,32] [--layers 4]
        [--out FILE.json]
Both sources must read the same records: revisions before the 4.625-bit records (super-blocks
of 8 groups) read 5-bit ones, so compare those with benchmarks/compare_checkouts.sh instead.
"""

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdec.machine import write_measurement
from specdec.models import int4, native
from specdec.models.huge_pages import into_huge_pages

SOURCE = native.KERNELS / "int4_matmul.cpp"
SHAPES = [(2 * 8960, 1536), (1536, 8960), (2048, 1536), (1536, 1536)]  # gate/up, down, q/k/v, o: [out, in]


def at_revision(revision: str, path: Path) -> bytes | None:
    """The file at ``revision``, None where it did not exist then."""
    shown = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True)
    return shown.stdout if shown.returncode == 0 else None


def build(source: Path, folder: Path, name: str) -> ctypes.CDLL:
    library = folder / f"{name}.so"
    subprocess.run(["g++", *native.compiler_flags(), str(source), "-o", str(library)], check=True)
    return native.declare(ctypes.CDLL(str(library)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision of the source to compare against")
    parser.add_argument("--base-file", help="a source file to compare against instead of the revision's")
    parser.add_argument("--rows", default="1,2,4,8,12,16,32", help="block sizes (rows of activations)")
    parser.add_argument("--layers", type=int, default=4, help="layers of weights, each its own records")
    parser.add_argument("--out", default="runs/int4_kernel_ab.json")
    args = parser.parse_args()
    relative = SOURCE.relative_to(Path(__file__).resolve().parents[2])
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "base.cpp"
        source = at_revision(args.base, relative) if not args.base_file else Path(args.base_file).read_bytes()
        if source is None:
            raise SystemExit(f"{relative} is not in {args.base}")
        base.write_bytes(source)
        for header in SOURCE.parent.glob("*.h"):  # the headers it includes, of the same revision (where it had them)
            text = at_revision(args.base, relative.parent / header.name)
            if text is not None:
                (Path(folder) / header.name).write_bytes(text)
        kernels = {"base": build(base, Path(folder), "base"), "tree": build(SOURCE, Path(folder), "tree")}
        torch.manual_seed(0)
        shapes = [(n, k) for n, k in SHAPES for _ in range(args.layers)]
        # In 2 MB pages, as a loaded model's records are (finish_network).
        records = into_huge_pages([int4.pack_weight(torch.randn(n, k) * 0.02).records for n, k in shapes])
        weights = [(record, n, k) for record, (n, k) in zip(records, shapes, strict=True)]
        rows_table = []
        for rows in [int(r) for r in args.rows.split(",")]:
            inputs = [torch.randn(rows, k) for _, _, k in weights]
            outputs = [torch.empty(rows, n) for _, n, _ in weights]
            best = dict.fromkeys(kernels, float("inf"))
            results = {}
            for _ in range(7):
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    for (records, n, k), x, y in zip(weights, inputs, outputs, strict=True):
                        kernel.specdec_int4_linear(x.data_ptr(), records.data_ptr(), y.data_ptr(), rows, n, k)
                    best[name] = min(best[name], time.perf_counter() - start)
                    results[name] = torch.cat([y.flatten() for y in outputs])
            difference = (results["tree"].double() - results["base"].double()).abs().max().item()
            row = {"rows": rows, "base_ms": round(best["base"] * 1e3, 3), "tree_ms": round(best["tree"] * 1e3, 3),
                   "tree_over_base": round(best["tree"] / best["base"], 3), "max_difference": difference}
            rows_table.append(row)
            print(f"{rows} rows: base {row['base_ms']:.2f} ms, tree {row['tree_ms']:.2f} ms, "
                  f"tree/base {row['tree_over_base']:.2f}, "
                  + ("same bits" if difference == 0 else f"differ by up to {difference:.3g}"))
    measured = {'base': args.base, 'flags': native.compiler_flags(), 'rows': rows_table}
    print(f"-> {write_measurement(args.out, measured)}")


if __name__ == "__main__":
    main()
