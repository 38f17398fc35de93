"""A prompt's prefill with its attention compiled (one chain call a layer, fused_layer.attend_chain)
against torch's SDPA with causal masks in blocks of 256 queries (what an int4 or w8a32 model's
prefill ran before), alternated in one process, each prompt as the engine feeds it (one forward,
no logits). Also checks, on this model and machine, that the compiled prefill gives the prompt's
last token the logits it gets when the rest is fed first (the bits of a verify block).

    python benchmarks/cpu/prompt_attention.py MODEL_DIR [--quantize int4] [--lengths 512,1257,4096]
        [--rounds 2] [--out runs/prompt_attention.json]

Prints, per prompt length and way, the median seconds, prompt tokens a second and the seconds
inside the compiled attention calls (the chain's; SDPA's are the rest's difference); writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec.models.fused_layer as fused_layer
from specdec.bench.suite import machine_description
from specdec.machine import write_measurement
from specdec.models.attention import attend_planned
from specdec.models.base import Attention
from specdec.models.loading import load

COMPILED = fused_layer.attend_compiled


def masked_sdpa(layer, q, k, v, plan, cache, layer_index):
    """A prompt's chain through torch's attention (attend_planned), as before the chain call."""
    if plan.groups:
        raise ValueError("only prompts here: a fresh cache's chain has no per-query tokens")
    return attend_planned(layer, q, k, v, plan, cache, layer_index)


WAYS = {"compiled chain": COMPILED, "torch SDPA, masked": masked_sdpa}


class TimedLibrary:
    """The compiled library, its specdec_attend_chain calls timed."""

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
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="runs/prompt_attention.json")
    args = parser.parse_args()
    model = load(args.model, quantize=args.quantize)
    if not isinstance(model.network.layers[0], fused_layer.FusedDecoderLayer):
        raise SystemExit(f"{model.name} in {args.quantize} runs torch layers here: nothing compiled to compare")
    timed = TimedLibrary(fused_layer.library())
    fused_layer.library = lambda: timed  # the compiled calls read it
    generator = torch.Generator().manual_seed(0)
    print(f"{machine_description()}; {model.name}, {model.precision}")
    print(f"{'tokens':>6} {'way':>20} {'seconds':>8} {'tok/s':>7} {'chain calls s':>13}")
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        tokens = torch.randint(100, model.vocab_size - 100, (length,), generator=generator)
        samples: dict[str, list[float]] = {way: [] for way in WAYS}
        inside: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(args.rounds):
            for way, function in WAYS.items():
                fused_layer.attend_compiled = function
                timed.seconds = 0.0
                samples[way].append(prefill_seconds(model, tokens))
                inside[way].append(timed.seconds)
        fused_layer.attend_compiled = COMPILED
        exact = last_token_as_in_a_block(model, tokens)
        for way in WAYS:
            seconds = statistics.median(samples[way])
            rows.append({"tokens": length, "way": way, "seconds": seconds, "samples": samples[way],
                         "chain_call_seconds": statistics.median(inside[way]), "last_token_as_in_a_block": exact})
            print(f"{length:6d} {way:>20} {seconds:8.2f} {length / seconds:7.1f} "
                  f"{statistics.median(inside[way]):13.2f}", flush=True)
        print(f"{length:6d} compiled: last token's logits as fed after the rest: {exact}")
    path = write_measurement(args.out, {"machine": machine_description(), "model": args.model,
                                        "precision": model.precision, "rows": rows})
    print(f"-> {path}")


if __name__ == "__main__":
    main()
