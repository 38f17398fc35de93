"""A prompt's prefill, as the engine feeds it (one forward, no logits), in each configuration: a
compiled layer library (built as kernel_library_ab.py says; "package": the installed one) and a
way of attending the prompt: "chain" (one compiled call a layer, fused_layer.attend_chain) or
"sdpa" (torch's attention with causal masks in blocks of 256 queries, what an int4 or w8a32
model's prefill ran before the chain call). Configurations alternate in one process (the VM's
speed drifts between processes). Also checks, on this model and machine, that the installed
library's prefill gives the prompt's last token the logits it gets when the rest is fed first
(the bits of a verify block).

    python benchmarks/cpu/prompt_prefill.py MODEL_DIR [--quantize int4] [--lengths 512,1257,4096]
        [--configs old.so:sdpa,package:sdpa,package:chain] [--rounds 2] [--out runs/prompt_prefill.json]

Prints, per prompt length and configuration, the median seconds, prompt tokens a second and the
seconds inside the chain calls; writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from long_context import library  # (this folder: the script's own path comes first)

import specdec.models.fused_layer as fused_layer
from specdec.bench.suite import machine_description
from specdec.machine import write_measurement
from specdec.models import native
from specdec.models.attention import attend_planned
from specdec.models.base import Attention
from specdec.models.loading import load


def masked_sdpa(layer, q, k, v, plan, cache, layer_index):
    """A prompt's chain through torch's attention (attend_planned), as before the chain call."""
    if plan.groups:
        raise ValueError("only prompts here: a fresh cache's chain has no per-query tokens")
    return attend_planned(layer, q, k, v, plan, cache, layer_index)


WAYS = {"chain": fused_layer.attend_compiled, "sdpa": masked_sdpa}


class TimedLibrary:
    """A compiled library, its specdec_attend_chain calls timed."""

    def __init__(self, handle) -> None:
        self.handle, self.seconds = handle, 0.0

    def __getattr__(self, name: str):
        function = getattr(self.handle, name)
        if name != "specdec_attend_chain":
            return function

        def timed(*args):
            started = time.perf_counter()
            function(*args)
            self.seconds += time.perf_counter() - started

        return timed


def prefill_seconds(model, tokens: torch.Tensor) -> float:
    cache = model.new_cache(rows=1, max_length=tokens.shape[0] + 1)
    started = time.perf_counter()
    model.forward(tokens, torch.arange(tokens.shape[0]), cache, Attention.chain(tokens.shape[0]), want_logits=False)
    return time.perf_counter() - started


def last_token_as_in_a_block(model, tokens: torch.Tensor) -> bool:
    """The prompt in one forward: its last token's logits equal those it gets fed after the rest."""
    whole = model.extend(tokens, model.new_cache(rows=1))
    cache = model.new_cache(rows=1)
    model.extend(tokens[:-1], cache)
    return torch.equal(whole[-1], model.extend(tokens[-1:], cache)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--quantize", default="int4")
    parser.add_argument("--lengths", default="512,1257,4096")
    parser.add_argument("--configs", default="package:sdpa,package:chain", help="LIBRARY:WAY, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="runs/prompt_prefill.json")
    args = parser.parse_args()
    model = load(args.model, quantize=args.quantize)
    if not isinstance(model.network.layers[0], fused_layer.FusedDecoderLayer):
        raise SystemExit(f"{model.name} in {args.quantize} runs torch layers here: nothing compiled to compare")
    installed = native.library()
    configs = {}
    for config in args.configs.split(","):
        path, _, way = config.rpartition(":")
        configs[config] = (TimedLibrary(installed if path == "package" else library(path)), WAYS[way])
    generator = torch.Generator().manual_seed(0)
    print(f"{machine_description()}; {model.name}, {model.precision}")
    print(f"{'tokens':>6} {'configuration':>30} {'seconds':>8} {'tok/s':>7} {'chain calls s':>13}")
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        tokens = torch.randint(100, model.vocab_size - 100, (length,), generator=generator)
        samples: dict[str, list[float]] = {name: [] for name in configs}
        inside: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, (timed, way) in configs.items():
                native.library = lambda timed=timed: timed  # the compiled calls read it
                fused_layer.attend_compiled = way
                timed.seconds = 0.0
                samples[name].append(prefill_seconds(model, tokens))
                inside[name].append(timed.seconds)
        native.library, fused_layer.attend_compiled = lambda: installed, WAYS["chain"]
        exact = last_token_as_in_a_block(model, tokens)
        for name in configs:
            seconds = statistics.median(samples[name])
            rows.append({"tokens": length, "config": name, "seconds": seconds, "samples": samples[name],
                         "chain_call_seconds": statistics.median(inside[name])})
            print(f"{length:6d} {name[-30:]:>30} {seconds:8.2f} {length / seconds:7.1f} "
                  f"{statistics.median(inside[name]):13.2f}", flush=True)
        print(f"{length:6d} installed library, chain: last token's logits as fed after the rest: {exact}")
        rows.append({"tokens": length, "last_token_as_in_a_block": exact})
    path = write_measurement(args.out, {"machine": machine_description(), "model": args.model,
                                        "precision": model.precision, "rows": rows})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
