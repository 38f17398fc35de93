"""The compiled kernel library: built, loaded and declared to ctypes here, and nowhere else.

One shared library holds every compiled kernel (specdec/models/kernels/): the int4 and w8a32
matmuls (int4.py, w8a32.py), a layer's work around them (layer_ops.cpp) and its attention
(attention.cpp) for fused_layer.py and drafting/fused_head.py, and the decoder stack in one call
(stack.cpp, layer_stack.py). The C prototypes of everything it exports are in
kernels/specdec_kernels.h; SIGNATURES below declares each of them to ctypes (tests/test_native.py
holds the two to each other).

It is compiled on first use for this CPU (`g++ -march=native`, or the instruction set
ATEN_CPU_CAPABILITY caps it to), kept in the cache folder as specdec-kernels-<key>.so under a key of
its sources and headers, the compiler, the flags and the machine (library_key: a new key builds and
checks anew), and loaded once a process. The kernels' self-checks against torch references run once
per key and machine, their results kept in $SPECDEC_CACHE/kernel-checks.json (cached_check). A
machine without a compiler gets KernelUnavailable, and the callers fall back (int8, the torch layers)
with a one-line notice saying why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from specdec.machine import cache_root, cached_measurement, machine_key

KERNELS = Path(__file__).parent / "kernels"
SOURCES = tuple(KERNELS / name for name in (
    "int4_matmul.cpp",  # int4.py's matmul
    "w8a32_matmul.cpp",  # w8a32.py's matmul
    "layer_ops.cpp",  # a layer's norms, RoPE, MLP and residuals around its matmuls (fused_layer.py)
    "attention.cpp",  # the compiled attention: per-query lists and chains (fused_layer.py)
    "stack.cpp",  # the decoder stack in one call (layer_stack.py)
))
# Included by the sources: part of the library's key.
HEADERS = tuple(KERNELS / name for name in ("specdec_kernels.h", "layer_common.h", "float16.h"))
LIBRARY_NAME = "specdec-kernels"
CHECKS_FILE = "kernel-checks.json"

FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
# ATEN_CPU_CAPABILITY caps the kernels' instruction set too, so an AVX-512 machine can run what an
# AVX2 (or plain x86-64) user gets; results are the same bits on every path.
MARCH = {"avx2": "x86-64-v3", "default": "x86-64"}

POINTER, INT64, FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
LINEAR = [POINTER] * 3 + [INT64] * 3  # x, w, y, M, N, K
# Every function the library exports: (restype, argtypes), in specdec_kernels.h's order.
SIGNATURES: dict[str, tuple[type | None, Sequence[type]]] = {
    "specdec_int4_isa": (ctypes.c_char_p, []),
    "specdec_int4_linear": (None, LINEAR),
    "specdec_w8a32_isa": (ctypes.c_char_p, []),
    "specdec_w8a32_linear": (None, LINEAR),
    "specdec_layer_qkv": (None, [INT64] + [POINTER] * 2 + [FLOAT] + [POINTER] * 4 + [INT64] * 2 + [POINTER] * 3
                          + [INT64] * 8),
    "specdec_head_qkv": (None, [INT64] + [POINTER] * 4 + [FLOAT] + [POINTER] * 4 + [INT64] * 5),
    "specdec_norm_linear": (None, [INT64] + [POINTER] * 2 + [FLOAT] + [POINTER] * 3 + [INT64] * 4),
    "specdec_layer_mlp": (None, [INT64] + [POINTER] * 6 + [FLOAT] + [POINTER] * 5 + [INT64] + [POINTER]
                          + [INT64] * 6),
    "specdec_attend": (None, [POINTER] * 3 + [INT64] + [POINTER] * 2 + [INT64] * 2 + [POINTER] * 4 + [INT64] * 5
                       + [FLOAT, POINTER, INT64, FLOAT]),
    "specdec_attend_chain": (None, [POINTER] * 3 + [INT64] + [POINTER] * 2 + [INT64] * 2 + [POINTER] + [INT64] * 6
                             + [FLOAT, POINTER, INT64, FLOAT]),
    "specdec_stack": (None, [POINTER, INT64, POINTER, INT64, INT64, POINTER, POINTER, INT64, POINTER, POINTER]
                      + [INT64] * 4 + [POINTER] * 13),
}


class KernelUnavailable(RuntimeError):
    """The compiled kernel library cannot be built or loaded on this machine."""


def compiler_flags() -> list[str]:
    """g++'s flags for the library (and for benchmarks' probes that must match it)."""
    return [f"-march={MARCH.get(os.environ.get('ATEN_CPU_CAPABILITY', '').lower(), 'native')}", *FLAGS]


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def library_key() -> str:
    """The sources, headers, compiler and machine (CPU, flags, ISA caps) the library is built for:
    a new key builds and checks anew."""
    text = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS) if path.is_file())
    text += " ".join([_compiler() or "", *compiler_flags(), machine_key()]).encode()
    return hashlib.sha256(text).hexdigest()[:16]


def declare(handle: ctypes.CDLL) -> ctypes.CDLL:
    """``handle`` with SIGNATURES declared on each function it exports (an older build, as the
    benchmarks' A/B load, may lack newer ones)."""
    for name, (restype, argtypes) in SIGNATURES.items():
        if hasattr(handle, name):
            function = getattr(handle, name)
            function.restype, function.argtypes = restype, argtypes
    return handle


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL:
    """The library, compiled once per machine and key into the cache folder, loaded and declared."""
    missing = [str(path) for path in (*SOURCES, *HEADERS) if not path.is_file()]
    if missing:
        raise KernelUnavailable(f"the compiled kernels' sources are missing from the package ({', '.join(missing)})")
    compiler = _compiler()
    if compiler is None:
        raise KernelUnavailable("no C++ compiler (g++) to build the compiled kernels; install one, or use "
                                "--quantize int8")
    path = cache_root() / "kernels" / f"{LIBRARY_NAME}-{library_key()}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run([compiler, *compiler_flags(), *map(str, SOURCES), "-o", str(partial)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelUnavailable(f"compiling the kernels failed: {result.stderr.strip()[-300:]}")
        partial.replace(path)
    handle = declare(ctypes.CDLL(str(path)))
    absent = [name for name in SIGNATURES if not hasattr(handle, name)]
    if absent:
        raise KernelUnavailable(f"the compiled kernels lack {', '.join(absent)}")
    return handle


def cached_check(key: str, name: str, check: Callable[[], str | None]) -> str | None:
    """check()'s problem (None: none) for the library of ``key`` under ``name``: run once per key
    and machine, then read back from $SPECDEC_CACHE/kernel-checks.json."""
    return cached_measurement(cache_root() / CHECKS_FILE, f"{key}:{name}", lambda: {"problem": check()})["problem"]


_library_checks: dict[tuple[str, str], str | None] = {}  # (library key, name) -> problem, this process


def library_check(name: str, check: Callable[[], str | None]) -> str | None:
    """None if the library builds here and passes ``check`` (cached_check: once per library and
    machine, then read once a process), else why not."""
    try:
        key = library_key()
        library()
    except KernelUnavailable as error:
        return str(error)
    if (key, name) not in _library_checks:
        _library_checks[key, name] = cached_check(key, name, check)
    return _library_checks[key, name]
