"""The default pair's target (SmolLM2-135M-Instruct) on every exact way to run it here: own
forward in int8 (the self-checked kernel), float32 and bfloat16 exact blocks, and llama.cpp on the
shipped Q4_1 GGUF (when llama-cpp-python is installed); target-only and n-gram (cost policy)
tokens per second on one suite prompt, best of 2, 64 tokens, greedy.
Usage: python benchmarks/cpu/default_pair_backends.py [--out FILE]"""
import argparse
import importlib.util
import time

from specdec.core.sampling import SamplingParams
from specdec.decoder import SpeculativeDecoder
from specdec.defaults import default_pair
from specdec.drafting import make_drafter
from specdec.machine import write_measurement
from specdec.models.loading import load

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="runs/default_pair_backends.json")
    args = parser.parse_args()
    pair = default_pair()
    ways = {"own int8": lambda: load(pair.target, quantize="int8"), "own float32 exact": lambda: load(pair.target),
            "own bfloat16 exact": lambda: load(pair.target, dtype="bfloat16")}
    if pair.target_gguf and importlib.util.find_spec("llama_cpp"):
        ways[f"llama.cpp {pair.target_gguf.name}"] = lambda: load(pair.target_gguf, backend="llama.cpp")
    settings = SamplingParams(max_new_tokens=64)
    result = {}
    for name, make in ways.items():
        model = make()
        for drafter in ("target-only", "ngram:cost"):
            decoder = SpeculativeDecoder(
                model, None if drafter == "target-only" else make_drafter("ngram"), policy="cost"
            )
            decoder.generate(PROMPT, SamplingParams(max_new_tokens=8))  # warm-up
            rates = []
            for _ in range(2):
                started = time.perf_counter()
                tokens = len(decoder.generate(PROMPT, settings).token_ids)
                rates.append(tokens / (time.perf_counter() - started))
            result.setdefault(name, {})[drafter] = round(max(rates), 1)
        print(f"{name:40s} " + "  ".join(f"{k}: {v} tok/s" for k, v in result[name].items()), flush=True)
        del model
    write_measurement(args.out, {"tokens_per_second": result})


if __name__ == "__main__":
    main()
