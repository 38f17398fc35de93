"""`specdec bench-batch`: throughput against batch size. The same N prompts are decoded in
batches of B (N/B generate() calls) for every B, so every batch size does the same work;
tokens/s is all generated tokens over the summed wall time (median of --repeats rounds).
Each batched greedy output is checked against the same prompt decoded alone."""

from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdec.decoder import GenerationResult, SpeculativeDecoder


def measure(decoder: SpeculativeDecoder, prompts: list[str], batch: int,
            max_new_tokens: int) -> tuple[float, list[GenerationResult]]:
    """Seconds to decode every prompt in batches of ``batch``; the outputs in prompt order."""
    outputs: list[GenerationResult] = []
    started = time.perf_counter()
    for start in range(0, len(prompts), batch):
        outputs += decoder.generate(prompts[start : start + batch], max_new_tokens=max_new_tokens)
    return time.perf_counter() - started, outputs


def bench_batch(target, draft, prompts: list[str], batch_sizes: list[int], max_new_tokens: int, gamma: int,
                repeats: int, progress=None) -> dict:
    from specdec.bench.suite import machine_description
    from specdec.decoder import SpeculativeDecoder

    methods = {"target-only": SpeculativeDecoder(target)}
    if draft is not None:
        methods[f"model:fixed gamma {gamma}"] = SpeculativeDecoder(target, draft, gamma=gamma)
    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []
    for name, decoder in methods.items():
        decoder.generate(prompts[:2], max_new_tokens=4)  # warm-up
        reference = None
        for batch in batch_sizes:
            times = []
            for _ in range(repeats):
                seconds, outputs = measure(decoder, prompts, batch, max_new_tokens)
                times.append(seconds)
                if progress:
                    progress(f"{name}, batch {batch}")
            ids = [o.token_ids for o in outputs]
            reference = reference or ids
            mismatches += [f"{name}, batch {batch}, prompt {i}"
                           for i, (a, b) in enumerate(zip(ids, reference, strict=True)) if a != b]
            tokens = sum(len(o.token_ids) for o in outputs)
            rows.append(
                {
                    "method": name,
                    "batch": batch,
                    "tokens": tokens,
                    "seconds": statistics.median(times),
                    "tokens_per_second": tokens / statistics.median(times),
                }
            )
    for row in rows:
        single = next(r for r in rows if r["method"] == row["method"] and r["batch"] == batch_sizes[0])
        row["vs_batch_1"] = row["tokens_per_second"] / single["tokens_per_second"]
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_description(),
        "target": target.name,
        "draft": draft.name if draft else None,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "rows": rows,
        "mismatches": mismatches,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["method"] == method]
        axes.plot([r["batch"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o", label=method)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("batch size (requests per step)")
    axes.set_ylabel("generated tokens / s")
    axes.set_title(f"{result['target']}, {result['date'][:10]}", fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
