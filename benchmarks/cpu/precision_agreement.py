"""Greedy agreement of the quantized precisions with float32 on one model: per prompt, how many
tokens int8 and int4 generate before their first difference from float32's (one prompt in 8 of
the bench suite, 48 tokens). A crude measure of what quantization costs: near-ties flip either way.

    python benchmarks/cpu/precision_agreement.py MODEL_DIR [--tokens 48] [--out FILE.json]
"""

import argparse
import json

from specdec import SamplingParams, SpeculativeDecoder
from specdec.bench.suite import machine_description
from specdec.defaults import default_prompts
from specdec.machine import write_measurement
from specdec.models.loading import load

PRECISIONS = {"float32": dict(exact=False), "int8": dict(quantize="int8"), "int4": dict(quantize="int4")}


def tokens_in_common(tokens: list[int], reference: list[int]) -> int:
    for position, (token, expected) in enumerate(zip(tokens, reference, strict=False)):
        if token != expected:
            return position
    return min(len(tokens), len(reference))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", default="runs/precision_agreement.json")
    args = parser.parse_args()
    prompts = [item["prompt"] for item in json.loads(default_prompts().read_text())][::8][:8]
    outputs = {}
    for name, options in PRECISIONS.items():
        decoder = SpeculativeDecoder(load(args.model, **options))
        outputs[name] = [decoder.generate(prompt, SamplingParams(max_new_tokens=args.tokens)).token_ids
                         for prompt in prompts]
    agreement = {name: [tokens_in_common(tokens, reference)
                        for tokens, reference in zip(outputs[name], outputs["float32"], strict=True)]
                 for name in ("int8", "int4")}
    for name, counts in agreement.items():
        print(f"{name}: {counts} tokens before the first difference from float32 (of {args.tokens}); "
              f"{sum(count == args.tokens for count in counts)} of {len(counts)} prompts identical")
    write_measurement(args.out, {"machine": machine_description(), "model": args.model, "tokens": args.tokens,
                                 "agreement_with_float32": agreement})
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
