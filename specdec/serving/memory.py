"""The server's KV-cache memory budget, chosen and stated before the first request.

The scheduler's cache is one pool of fixed-size blocks (models/paged_cache.py) shared by every
request and the prefix cache: a request takes blocks as its prompt and output need them and
gives them back when it ends, so one long request can use what many short ones leave free. The
budget fixes the pool (budget / bytes of one token's keys and values in every layer); the longest
request (``--max-model-len``) is the model's context, or the pool if that is smaller, and the
engine refuses a longer prompt with a 400 before it is fed. When the pool runs dry, stored prompts
go first, then the youngest request is preempted (its blocks freed, its cache recomputed later,
its text unchanged: serving/scheduler.py).

The pool is allocated once and never grows, and its pages become resident only as blocks are
first used. The default budget is a third of the memory available at start: the rest stays for
the weights, the drafters' own caches and a forward's activations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.models.paged_cache import BLOCK_SIZE

if TYPE_CHECKING:
    from specdec.models.base import LanguageModel

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


def human(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class KVBudget:
    """A pool of pool_tokens tokens' keys and values (pool_tokens x bytes_per_token <= budget_bytes);
    one request holds at most max_model_len of them (prompt and output)."""

    budget_bytes: int
    bytes_per_token: int
    pool_tokens: int
    max_model_len: int
    source: str  # how the budget was chosen, for the start line

    def describe(self, max_batch: int, block_size: int = BLOCK_SIZE) -> str:
        """The one line a server prints at start."""
        blocks = self.pool_tokens // block_size
        return (f"KV cache: {human(self.budget_bytes)} budget ({self.source}): a pool of {blocks:,} blocks of "
                f"{block_size} tokens = {blocks * block_size:,} tokens x {human(self.bytes_per_token)} a token, "
                f"shared by up to {max_batch} requests and the prefix cache; one request up to "
                f"{self.max_model_len:,} tokens (--max-model-len: prompt and output)")


def plan_kv_budget(bytes_per_token: int, rows: int, context: int, kv_cache_memory: int | None = None,
                   max_model_len: int | None = None, available: int | None = None) -> KVBudget:
    """The pool and the longest request for ``rows`` requests (and stored prompts) sharing a
    pool of ``bytes_per_token`` a token, on a model whose context is ``context`` tokens. The
    budget: ``kv_cache_memory``, else DEFAULT_SHARE of ``available`` (never more than every row's
    whole context). Raises ValueError naming the option when nothing useful fits."""
    if max_model_len is not None and not 2 <= max_model_len <= context:
        raise ValueError(f"--max-model-len must be 2..{context} (the model's context), got {max_model_len}")
    if kv_cache_memory is not None and kv_cache_memory <= 0:
        raise ValueError(f"--kv-cache-memory must be positive, got {kv_cache_memory}")
    everything = rows * context * bytes_per_token  # every row at the whole context: more is never used
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, "--kv-cache-memory"
    elif available is None:
        budget, source = everything, "every row's whole context: available memory unknown"
    elif int(available * DEFAULT_SHARE) < everything:
        budget, source = int(available * DEFAULT_SHARE), f"a third of the {human(available)} available at start"
    else:
        budget, source = everything, "every row's whole context, within a third of the memory available"
    pool = budget // bytes_per_token // BLOCK_SIZE * BLOCK_SIZE
    longest = min(context, pool)
    if max_model_len is not None:
        if max_model_len > pool:
            raise ValueError(f"--max-model-len {max_model_len} x {human(bytes_per_token)} a token needs "
                             f"{human(max_model_len * bytes_per_token)}, over the KV cache's {human(budget)} "
                             f"({source}): raise --kv-cache-memory or lower --max-model-len")
        longest = max_model_len
    if longest < 2:
        raise ValueError(f"a KV-cache budget of {human(budget)} holds {pool} tokens of {human(bytes_per_token)}: "
                         "raise --kv-cache-memory")
    return KVBudget(budget, bytes_per_token, pool, longest, source)


def kv_budget(target: LanguageModel, max_batch: int, prefix_cache_rows: int, kv_cache_memory: str | None = None,
              max_model_len: int | None = None) -> KVBudget | None:
    """The KV-cache budget of a server with these rows ; None for a backend
    whose cache is not ours to size (llama.cpp, transformers)."""
    from specdec.machine import available_memory

    per_token = getattr(target.new_cache(rows=1, max_length=2), "bytes_per_token", None)
    if per_token is None:
        return None
    return plan_kv_budget(per_token, max_batch + prefix_cache_rows, target.max_context,
                          None if kv_cache_memory is None else parse_size(kv_cache_memory), max_model_len,
                          available_memory())
