"""`specdec bench-forward`: time per token of specdec's own forward vs transformers' on the same
random Llama config, and the verify cost T(k) of a k-token block, measured in one run."""

from __future__ import annotations

import datetime
import tempfile

import torch

from specdec.models.timing import prefilled_cache, time_block  # noqa: F401 (the docs' scripts import them from here)


def time_forward(model, block: int, repeats: int, context: int = 64) -> float:
    """Median seconds of one forward of `block` tokens after `context` cached tokens."""
    return time_block(model, prefilled_cache(model, 1, context), block, repeats)


def bench_forward(hidden: int = 384, layers: int = 8, vocab: int = 8192, heads: int = 6, kv_heads: int = 2,
                  intermediate: int = 1024, repeats: int = 50, blocks: tuple[int, ...] = (1, 2, 4, 8)) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.bench.suite import machine_description
    from specdec.models.loading import load

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=1024)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        model = LlamaForCausalLM(config)
        parameters = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        engines = {
            "specdec fp32": load(folder, backend="specdec"),
            "specdec fp32 inexact": load(folder, backend="specdec", exact=False),
            "transformers fp32": load(folder, backend="transformers"),
            "specdec int8": load(folder, backend="specdec", quantize="int8"),
        }
        results: dict[str, dict[int, float]] = {name: {} for name in engines}
        for block in blocks:  # engines interleaved per block size: they share the machine's noise
            for name, engine in engines.items():
                results[name][block] = time_forward(engine, block, repeats)
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_description(),
        "config": {"hidden": hidden, "layers": layers, "vocab": vocab, "heads": heads, "kv_heads": kv_heads,
                   "intermediate": intermediate, "parameters": parameters},
        "seconds": {name: {str(k): v for k, v in times.items()} for name, times in results.items()},
    }
