"""A torch int8 target with its draft on llama.cpp (the Q8_0 GGUF) vs the torch int8 draft: 4 suite
prompts (one per category), 64 tokens, gamma 4, greedy. python mixed_backends.py [MODELS_DIR]"""
import sys
import time
from pathlib import Path

from specdec import SpeculativeDecoder, load, make_drafter
from specdec.bench.suite import load_prompts
from specdec.defaults import default_prompts

M = Path(sys.argv[1] if len(sys.argv) > 1 else "/work/models")  # as ../shared/real-models/fetch.sh builds it
target = load(str(M / "qwen2.5-coder-1.5b"), quantize="int8")
draft_torch = load(str(M / "qwen2.5-coder-0.5b"), quantize="int8")
draft_gguf = load(str(M / "gguf/qwen2.5-coder-0.5b-instruct.gguf"))
prompts = [p.text for p in load_prompts(default_prompts(), 1)]
tokens = 64
decoders = {"target-only": SpeculativeDecoder(target)}
for kind in ("model", "staged"):
    decoders[f"{kind} torch-int8 draft"] = SpeculativeDecoder(
        target, make_drafter(kind, draft_torch, target=target), gamma=4
    )
    decoders[f"{kind} llama.cpp draft"] = SpeculativeDecoder(
        target, make_drafter(kind, draft_gguf, target=target), gamma=4
    )
for d in decoders.values():
    d.generate(prompts[0], max_new_tokens=8)  # warm-up
results = {name: {"tokens": 0, "seconds": 0.0, "ids": []} for name in decoders}
for prompt in prompts:
    for name, decoder in decoders.items():
        began = time.perf_counter()
        result = decoder.generate(prompt, max_new_tokens=tokens)
        results[name]["seconds"] += time.perf_counter() - began
        results[name]["tokens"] += len(result.token_ids)
        results[name]["ids"].append(result.token_ids)
        results[name].setdefault("draft_s", 0.0)
        results[name]["draft_s"] += result.stats.draft_seconds
        results[name].setdefault("verify_s", 0.0)
        results[name]["verify_s"] += result.stats.verify_seconds
        results[name].setdefault("tau", []).append(result.stats.tau)
base = results["target-only"]
for name, r in results.items():
    rate = r["tokens"] / r["seconds"]
    print(
        f"{name:28s} {rate:6.2f} tok/s  {rate / (base['tokens'] / base['seconds']):.2f}x  "
        f"draft {r['draft_s']:.1f}s verify {r['verify_s']:.1f}s tau {sum(r['tau']) / len(r['tau']):.2f} "
        f"same={r['ids'] == base['ids']}"
    )
