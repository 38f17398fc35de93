"""Which way of running a model is fastest *and exact* on this machine: measured once, cached.

No fixed rule picks a backend: which is faster depends on the instruction set (on an AVX2-only
CPU oneDNN's u8 x s8 path is compute-bound and llama.cpp's kernels win by several times;
docs/design.md, "The CPU table"), and nothing says the order is the same on another CPU. Each
candidate is loaded, checked (a verify block must score every token exactly as alone: lossless
against an inexact block is not lossless) and timed on a one-token and a five-token forward; the
fastest exact one wins. The result is kept in ``$SPECDEC_CACHE/backend-choice.json`` under the
machine key (CPU, flags, torch, ISA caps) and the caller's key, so only the first use pays for the
measurement.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.machine import cache_root, cached_measurement
from specdec.models.base import LanguageModel
from specdec.models.timing import prefilled_cache, time_block

CONTEXT, BLOCK = 32, 5


@dataclass(frozen=True)
class Choice:
    name: str  # the chosen candidate
    milliseconds: dict[str, float] = field(default_factory=dict)  # candidate -> T(1) + T(BLOCK)
    refused: dict[str, str] = field(default_factory=dict)  # candidate -> why it cannot run exactly here

    def line(self) -> str:
        others = [f"{name} {ms:.0f} ms" for name, ms in self.milliseconds.items() if name != self.name]
        others += [f"{name}: {reason}" for name, reason in self.refused.items()]
        mine = self.milliseconds.get(self.name)
        return (
            f"{self.name}"
            + (f" ({mine:.0f} ms for a 1- plus a {BLOCK}-token forward" if mine else " (")
            + (f"; {', '.join(others)}" if others else "")
            + "; measured once on this machine)"
        )


def block_is_exact(model: LanguageModel, count: int = BLOCK) -> bool:
    """A count-token block's logits equal each token's scored alone after the same context."""
    tokens = (torch.arange(CONTEXT + count) * 7 % model.vocab_size).to(model.device)
    block_cache, alone_cache = model.new_cache(), model.new_cache()
    model.extend(tokens[:CONTEXT], block_cache)
    model.extend(tokens[:CONTEXT], alone_cache)
    block = model.extend(tokens[CONTEXT:], block_cache)
    alone = torch.cat([model.extend(tokens[i : i + 1], alone_cache) for i in range(CONTEXT, CONTEXT + count)])
    return torch.equal(block, alone)


# Bumped when the way of measuring changes, so that entries measured the old way are measured again.
# 2: every block size warmed up before it is timed (first-use work, such as a kernel's per-shape
# check or a scratch buffer's first growth, once put int4 at 17x its steady T(1) + T(6)).
MEASUREMENT = 2


def forward_milliseconds(model: LanguageModel, repeats: int = 5, warmups: int = 2) -> float:
    """Median T(1) + T(BLOCK) after CONTEXT cached tokens, each block size timed in its steady
    state: ``warmups`` untimed forwards of it first."""
    cache = prefilled_cache(model, 1, CONTEXT)
    for count in (1, BLOCK):
        time_block(model, cache, count, warmups)
    return sum(time_block(model, cache, count, repeats) for count in (1, BLOCK)) * 1000


def choose_fastest_exact(
    candidates: dict[str, Callable[[], LanguageModel]],
    key: str,
    progress: Callable[[str], None] | None = None,
    cache_file: Path | None = None,
) -> Choice:
    """The fastest candidate whose verify blocks are exact here (cached under key + machine)."""

    def measure() -> dict:
        milliseconds: dict[str, float] = {}
        refused: dict[str, str] = {}
        for name, load in candidates.items():
            if progress:
                progress(f"measuring {name} on this machine (once)")
            try:
                model = load()
            except (ImportError, ValueError, RuntimeError, OSError) as error:
                refused[name] = f"cannot load ({str(error).splitlines()[0][:80]})"
                continue
            if block_is_exact(model):
                milliseconds[name] = round(forward_milliseconds(model), 2)
            else:
                refused[name] = "verify blocks not exact here"
            del model
            gc.collect()
        if not milliseconds:
            raise RuntimeError(f"no exact way to run {key} here: {refused}")
        return {
            "name": min(milliseconds, key=milliseconds.__getitem__),
            "milliseconds": milliseconds,
            "refused": refused,
        }

    path = cache_file or cache_root() / "backend-choice.json"
    return Choice(**cached_measurement(path, [torch.get_num_threads(), key, sorted(candidates), MEASUREMENT],
                                       measure))
