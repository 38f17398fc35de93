"""What the grammar engine costs per token on a real tokenizer: building the vocabulary view, a
matcher per schema, and the allowed-token mask (llguidance via specdec.grammar) along documents of
the JSON-extraction suite's schemas. The documents are random walks through each grammar (a token
drawn uniformly among the allowed ones, the end token once allowed after 200 tokens), so every
mask is computed at a real position of a valid document.

    python benchmarks/structured/mask_cost.py MODEL_DIR [--out runs/mask_cost.json]
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from specdec import Constraint
from specdec.grammar import GrammarCompiler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model folder (its tokenizer and vocabulary size are read)")
    parser.add_argument("--suite", default="specdec/assets/bench_json.json")
    parser.add_argument("--out", default="runs/mask_cost.json")
    args = parser.parse_args()
    tokenizer, config = AutoTokenizer.from_pretrained(args.model), AutoConfig.from_pretrained(args.model)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    eos_token_ids = tuple(dict.fromkeys([*eos, tokenizer.eos_token_id]))
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, config.vocab_size, eos_token_ids)
    build_seconds = time.perf_counter() - started
    rng = random.Random(0)
    matcher_ms, mask_ms, draft_ms, lengths = [], [], [], []
    for item in json.loads(Path(args.suite).read_text()):
        started = time.perf_counter()
        matcher = compiler.matcher(Constraint.json_schema(item["json_schema"]))
        matcher_ms.append((time.perf_counter() - started) * 1e3)
        walked = 0
        while True:
            started = time.perf_counter()
            allowed = matcher.allowed()
            mask_ms.append((time.perf_counter() - started) * 1e3)
            choices = allowed.nonzero().flatten().tolist()
            ends = [token for token in choices if token in eos_token_ids]
            if ends and (walked >= 200 or len(choices) == len(ends)):
                break
            token = rng.choice([token for token in choices if token not in eos_token_ids])
            started = time.perf_counter()
            matcher.masks_along([token], None)  # a one-token draft's look-ahead: 2 masks and a rollback
            draft_ms.append((time.perf_counter() - started) * 1e3)
            matcher.consume([token])
            walked += 1
        lengths.append(walked)

    def quantiles(values: list[float]) -> dict:
        ordered = sorted(values)
        return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
                "mean": statistics.fmean(ordered)}

    result = {"model": Path(args.model).name, "vocab_size": config.vocab_size, "vocabulary_view_seconds": build_seconds,
              "documents": len(lengths), "tokens": sum(lengths), "matcher_ms": quantiles(matcher_ms),
              "mask_ms": quantiles(mask_ms), "one_token_look_ahead_ms": quantiles(draft_ms)}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['model']}: vocabulary view {build_seconds:.2f} s; {len(lengths)} documents, {sum(lengths)} tokens")
    for name in ("matcher_ms", "mask_ms", "one_token_look_ahead_ms"):
        print(f"  {name}: median {result[name]['median']:.4f}, p90 {result[name]['p90']:.4f}, "
              f"mean {result[name]['mean']:.4f}")


if __name__ == "__main__":
    main()
