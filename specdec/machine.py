"""What specdec measures once per machine, and where it keeps it: converted models, int8 kernel
checks, backend choices, a server's verify costs. A machine is its CPU model and flags, the torch
build and the ISA caps (`ONEDNN_MAX_CPU_ISA`, `ATEN_CPU_CAPABILITY`): what decides which kernels
are exact and fast."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch


def cache_root() -> Path:
    """``$SPECDEC_CACHE``, else ``$XDG_CACHE_HOME/specdec``, else ``~/.cache/specdec``."""
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec"


def seconds_since_start() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that cannot be read."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def available_memory() -> int | None:
    """Bytes the machine can still give (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def read_json_cache(path: Path) -> dict:
    """A cache file's contents, or {} if it is missing or unreadable (then it is measured again)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}


def write_json_cache(path: Path, contents: dict) -> None:
    """Replace the file atomically (concurrent readers see the old file or the new one); a
    read-only cache folder only costs a new measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(contents, indent=1))
        partial.replace(path)
    except OSError:
        pass


@functools.cache
def cpu_description() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and flags in /proc/cpuinfo's order (the first processor's; no flags
    where there is no such file)."""
    flags: tuple[str, ...] = ()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = tuple(line.split(":", 1)[1].split())
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model or platform.processor(), flags


def machine_key() -> str:
    """What decides which kernels are exact and fast: the CPU, its flags, torch, the ISA caps."""
    model, flags = cpu_description()
    caps = {name: os.environ.get(name, "") for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    # The flags as /proc/cpuinfo's line writes them, so keys (and the measurements cached under them) stay valid.
    text = json.dumps([model, " " + " ".join(flags), torch.__version__, caps, platform.machine()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def isa_summary() -> str:
    """'AVX2, no AVX-512 VNNI, no AMX'-style words for the CLI's notice."""
    flags = set(cpu_description()[1])
    if not flags:
        return platform.machine()
    words = [name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags][:1]
    words.append("VNNI" if flags & {"avx512_vnni", "avx_vnni"} else "no VNNI")
    words.append("AMX" if "amx_int8" in flags else "no AMX")
    return ", ".join(words)


def has_fast_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX or AVX-512 BF16): where autocast to
    bfloat16 pays for training (measured on AMX: docs/heads.md)."""
    return bool({"amx_bf16", "avx512_bf16"} & set(cpu_description()[1]))


Measured = TypeVar("Measured")


def cached_measurement(path: Path, key: object, measure: Callable[[], Measured]) -> Measured:
    """``measure()``'s JSON-able result, kept in ``path`` under this machine and ``key``:
    measured on the first call here, read back on every later one (as JSON gives it back: the
    caller's result type must survive a JSON round trip)."""
    full_key = json.dumps([machine_key(), key])
    stored: dict[str, Any] = read_json_cache(path)
    if full_key not in stored:
        stored[full_key] = measure()
        write_json_cache(path, stored)
    return stored[full_key]


def write_measurement(path: str | Path, results: dict) -> Path:
    """A benchmark script's JSON: the results with when and on what they were measured."""
    import datetime

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"), "isa": isa_summary(),
                                "torch": torch.__version__, "threads": torch.get_num_threads(), **results}, indent=1))
    return path
