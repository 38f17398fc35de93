"""Is the default precision right on this CPU? The quickstart prompt and 8 more (2 per bench
category) through the default pair as `specdec generate` runs it (int8, its default drafter and
policy), against the same target in float32 greedy, target alone. Prints a table, writes JSON.

    python scripts/int8_vs_float32.py [--max-new-tokens 64] [--out runs/int8-vs-fp32.json]
        [--kernel int_mm-8bit]   # force one int8 kernel (e.g. exact 8-bit activations on any CPU)
        [--llama-cpp]            # the target on llama.cpp with the pair's own GGUF instead of int8
        [--quantize int4]        # the own forward in another precision than the pair's

A mismatch is reported with the float32 target's top-2 logit margin at the first differing
token: int8 rounds activations, so a near-tie may legitimately go the other way; junk (a kernel
that saturates) differs early and at wide margins.
"""

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

from specdec.bench.suite import load_prompts, machine_description
from specdec.core.sampling import SamplingParams
from specdec.decoder import SpeculativeDecoder
from specdec.defaults import default_pair, default_prompts
from specdec.drafting import make_drafter
from specdec.models import int8_kernels, quantize
from specdec.models.loading import load

QUICKSTART_PROMPT = "def fibonacci(n):"


def top2_margin(model, ids: list[int]) -> float:
    logits = model.extend(torch.tensor(ids), model.new_cache())[-1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="runs/int8-vs-fp32.json")
    parser.add_argument("--kernel", choices=[kernel.name for kernel in int8_kernels.CANDIDATES])
    parser.add_argument("--llama-cpp", action="store_true")
    parser.add_argument("--quantize", choices=["int8", "int4", "w8a32"],
                        help="own forward's precision (default: the pair's)")
    args = parser.parse_args()
    if args.kernel:
        int8_kernels.CANDIDATES = [k for k in int8_kernels.CANDIDATES if k.name == args.kernel]
        quantize.KERNELS = int8_kernels.KernelCache(None)  # checked here, not taken from the cache
    pair = default_pair()
    precision = args.quantize or pair.quantize
    prompts = [QUICKSTART_PROMPT] + [item.text for item in load_prompts(default_prompts(), 2)]
    reference = load(pair.target)  # float32, exact blocks
    target = (
        load(pair.target_gguf, backend="llama.cpp") if args.llama_cpp else load(pair.target, quantize=precision)
    )
    draft = load(pair.draft, quantize=precision)
    print(quantize.kernel_notice())
    settings = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    for prompt in prompts:
        expected = SpeculativeDecoder(reference, None).generate(prompt, settings)
        drafter = make_drafter(pair.drafter, draft, target=target)
        got = SpeculativeDecoder(target, drafter, policy=pair.policy).generate(prompt, settings)
        same = got.token_ids == expected.token_ids
        row = {"prompt": prompt[:40], "same_text": same, "tokens": len(expected.token_ids)}
        if not same:
            first = next(
                (i for i, (a, b) in enumerate(zip(got.token_ids, expected.token_ids, strict=False)) if a != b),
                min(len(got.token_ids), len(expected.token_ids)),
            )
            row["first_difference"] = first
            row["fp32_top2_margin_there"] = top2_margin(
                reference, list(expected.prompt_ids) + expected.token_ids[:first]
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_description(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pair": pair.name,
        "target": "llama.cpp " + pair.target_gguf.name if args.llama_cpp else f"own {precision}",
        "kernels": quantize.kernel_notice(),
        "same": sum(r["same_text"] for r in rows),
        "of": len(rows),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"same text as float32 greedy: {summary['same']} of {summary['of']} prompts -> {args.out}")


if __name__ == "__main__":
    main()
