"""The server's KV-cache memory budget, chosen and stated before the first request.

The scheduler's cache is one block of ``rows`` rows (``--max-batch`` request rows and the
prefix cache's spare rows) that all have the same number of slots: a forward attends over a
batch of rows as one padded tensor (models/attention.py), so the rows cannot each have their own
length. What bounds its memory is then rows x the longest request (prompt and output) x the bytes
of one token's keys and values in every layer; the budget fixes the longest request
(``--max-model-len``) so that the product fits, the engine refuses a longer prompt with a 400
before it is fed, and the cache grows only as far as the requests it holds need and shrinks again
when they end (Scheduler.release), so it never stays at the longest request seen.

While the cache grows or shrinks, the old and the new tensors are both alive for a moment: the
default budget is a third of the memory available at start, so that peak stays inside two thirds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

#: Of the memory available at start, the default budget takes this share (see the module docstring).
DEFAULT_SHARE = 1 / 3
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes from "8GiB", "6G", "512MB" or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (write e.g. 8GiB, 6G, 512MB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[unit])


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


def human(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class KVBudget:
    """rows x max_model_len x bytes_per_token <= budget_bytes."""

    budget_bytes: int
    bytes_per_token: int
    rows: int
    max_model_len: int
    source: str  # how the budget was chosen, for the start line

    @property
    def bytes_per_row(self) -> int:
        return self.max_model_len * self.bytes_per_token

    def describe(self, request_rows: int) -> str:
        """The one line a server prints at start."""
        spare = self.rows - request_rows
        return (f"KV cache: {human(self.budget_bytes)} budget ({self.source}): {self.rows} rows ({request_rows} "
                f"requests + {spare} prefix-cache) x {self.max_model_len} tokens (--max-model-len: prompt and "
                f"output of one request) x {human(self.bytes_per_token)} per token = {human(self.bytes_per_row)} "
                "a row at most; rows grow only as long as their requests need")


def plan_kv_budget(bytes_per_token: int, rows: int, context: int, kv_cache_memory: int | None = None,
                   max_model_len: int | None = None, available: int | None = None) -> KVBudget:
    """The budget and the longest request for a cache of ``rows`` rows of ``bytes_per_token``
    each, for a model whose context is ``context`` tokens. Given both, they must agree; given one,
    the other follows; given neither, the budget is DEFAULT_SHARE of ``available`` (at most what
    the whole context needs). Raises ValueError naming the option when nothing useful fits."""
    if max_model_len is not None and not 2 <= max_model_len <= context:
        raise ValueError(f"--max-model-len must be 2..{context} (the model's context), got {max_model_len}")
    if kv_cache_memory is not None and kv_cache_memory <= 0:
        raise ValueError(f"--kv-cache-memory must be positive, got {kv_cache_memory}")
    per_length = rows * bytes_per_token  # bytes per token of max_model_len
    if kv_cache_memory is None and max_model_len is not None:
        budget, source = max_model_len * per_length, "--max-model-len x rows"
        if available is not None and budget > available:
            raise ValueError(f"--max-model-len {max_model_len} needs {human(budget)} of KV cache for {rows} rows, "
                             f"and {human(available)} is available: lower it, --max-batch or --prefix-cache-rows")
        return KVBudget(budget, bytes_per_token, rows, max_model_len, source)
    if kv_cache_memory is None:
        if available is None:
            budget, source = context * per_length, "the whole context: available memory unknown"
        else:
            budget = min(int(available * DEFAULT_SHARE), context * per_length)
            source = f"a third of the {human(available)} available at start" if budget < context * per_length \
                else "the whole context, within a third of the memory available"
    else:
        budget, source = kv_cache_memory, "--kv-cache-memory"
    longest = min(context, budget // per_length)
    if max_model_len is not None:
        if max_model_len > longest:
            raise ValueError(f"--max-model-len {max_model_len} x {rows} rows x {human(bytes_per_token)} a token "
                             f"needs {human(max_model_len * per_length)}, over --kv-cache-memory "
                             f"{human(budget)}: raise it or lower --max-model-len, --max-batch or --prefix-cache-rows")
        longest = max_model_len
    if longest < 2:
        raise ValueError(f"a KV-cache budget of {human(budget)} holds {longest} tokens a row for {rows} rows of "
                         f"{human(bytes_per_token)} a token: raise --kv-cache-memory or lower --max-batch")
    return KVBudget(budget, bytes_per_token, rows, longest, source)
