"""How long a model's forward takes: T(k) for a k-token block after a cached context. Used by
the benchmarks, the server's cost profile and the per-machine backend choice."""

from __future__ import annotations

import statistics
import time

import torch

from specdec.models.base import Attention, Segment


def prefilled_cache(model, rows: int = 1, context: int = 64):
    """A cache whose rows each hold the same ``context`` tokens, ready for timing blocks after them."""
    cache = model.new_cache(rows=rows)
    prefix = (torch.arange(context) % model.vocab_size).to(model.device)
    for row in range(rows):
        model.extend(prefix, cache, row)
    return cache


def time_block(model, cache, block: int, repeats: int, batch: int = 1) -> float:
    """Median seconds of one forward of ``batch`` rows of ``block`` tokens after each row's cached
    context (rows 0..batch-1 of a prefilled_cache). Nothing is committed, so every repeat scores
    the same positions."""
    context = cache.lengths[0]
    tokens = (torch.arange(block) % model.vocab_size).repeat(batch).to(model.device)
    positions = torch.arange(context, context + block).repeat(batch).to(model.device)
    attention = Attention(tuple(Segment(row, block) for row in range(batch)))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.forward(tokens, positions, cache, attention).logits.argmax(-1).tolist()  # wait for the result
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)
