"""How far drafts of one or more heads reach on the bench suite (no timing): greedy, a chain of
``--gamma`` tokens, each head on the same prompts; the share of steps that accepted depth 1, 2, ...
and tau (tokens a target forward emits). Every text is checked equal to the target alone's.

    python benchmarks/cpu/head_acceptance.py --target $M/qwen2.5-coder-1.5b --quantize int8 \\
        --heads heads/qwen2.5-coder-1.5b-instruct /path/to/other/head --prompts 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdec import SamplingParams, SpeculativeDecoder, load, make_drafter
from specdec.decoder import GenerationResult

SUITE = Path(__file__).resolve().parents[2] / "specdec" / "assets" / "bench_prompts.json"


def generated(decoder: SpeculativeDecoder, prompt: list[int], settings: SamplingParams) -> GenerationResult:
    result = decoder.generate(prompt, settings)
    assert not isinstance(result, list)  # one prompt, one result
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--prompts", type=int, default=16, help="spread evenly over the suite's 64")
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    target = load(args.target, quantize=None if args.quantize == "none" else args.quantize)
    suite = [entry["prompt"] for entry in json.loads(SUITE.read_text())]
    chosen = suite[:: max(1, len(suite) // args.prompts)][: args.prompts]
    prompts = [target.tokenizer(text)["input_ids"] for text in chosen]
    settings = SamplingParams(max_new_tokens=args.max_new_tokens)
    alone = SpeculativeDecoder(target)
    references = [generated(alone, prompt, settings).token_ids for prompt in prompts]
    for head in args.heads:
        decoder = SpeculativeDecoder(target, make_drafter("head", target=target, head=head), gamma=args.gamma)
        drafted, accepted = [0] * args.gamma, [0] * args.gamma
        for prompt, reference in zip(prompts, references, strict=True):
            result = generated(decoder, prompt, settings)
            if result.token_ids != reference:
                raise SystemExit(f"{head}: the text differs from the target alone's (a bug)")
            for depth, (steps, hits) in enumerate(zip(result.stats.drafted_at, result.stats.accepted_at, strict=True)):
                drafted[depth] += steps
                accepted[depth] += hits
        print(json.dumps({
            "head": head, "prompts": len(prompts), "steps": drafted[0],
            "reach_depth": [round(hits / max(steps, 1), 3) for steps, hits in zip(drafted, accepted, strict=True)],
            "tau": round(1 + sum(accepted) / max(drafted[0], 1), 3),
        }), flush=True)


if __name__ == "__main__":
    main()
