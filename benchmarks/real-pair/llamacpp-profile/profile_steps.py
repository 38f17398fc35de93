"""Where a speculative step's time goes on the llama.cpp backend (docs/llama-cpp.md, "Where the
time goes"). Run from the repository root, alone on the machine:

    python benchmarks/real-pair/llamacpp-profile/profile_steps.py TARGET.gguf DRAFT.gguf

Prints, for each GGUF with plain ggml kernels (what the backend uses) and with repacked weights
(llama.cpp's default): T(k), the median time of one k-token decode after a 64-token context, and
the largest logit difference between that block and its tokens decoded one at a time; then a
draft/target alternation as in speculation, the Python-side costs per verify block, and the
share of a whole generation spent inside llama_decode.
"""

import ctypes
import statistics
import sys
import time

import numpy as np
import torch

import specdec.models.llama_cpp as backend
from specdec.core.sampling import SamplingParams, logits_to_probs
from specdec.models.base import Attention

CONTEXT = torch.arange(1000, 1064)  # 64 arbitrary tokens
REPEATS = 4


def network(path: str, repacked: bool) -> backend.LlamaCppNetwork:
    lib = backend.import_llama_cpp()
    lib.llama_backend_init()
    lib.llama_log_set(backend.LOG_SILENT, ctypes.c_void_p())
    params = lib.llama_model_default_params()
    params.use_extra_bufts = repacked
    model = lib.llama_model_load_from_file(path.encode(), params)
    return backend.LlamaCppNetwork(lib, model, 2048, 4, 512, 2, True)


def block_costs(net: backend.LlamaCppNetwork) -> dict[int, tuple[float, float]]:
    """k -> (median ms of a k-token decode, max |block logits - one-at-a-time logits|)."""
    cache = net.new_cache(4096, 1)
    net(CONTEXT, torch.arange(64), cache, Attention.chain(64))
    cache.commit(0, 64)
    costs = {}
    for k in (1, 2, 3, 4, 5, 9):
        tokens, positions, times = torch.arange(2000, 2000 + k), torch.arange(64, 64 + k), []
        for _ in range(REPEATS):
            began = time.perf_counter()
            block = net(tokens, positions, cache, Attention.chain(k)).logits
            times.append(time.perf_counter() - began)
            cache.crop(0)
        alone = []
        for i in range(k):
            alone.append(net(tokens[i : i + 1], positions[i : i + 1], cache, Attention.chain(1)).logits)
            cache.commit(0, 1)
        cache.rollback(0, 64)
        costs[k] = (round(statistics.median(times) * 1000, 1), round((block - torch.cat(alone)).abs().max().item(), 3))
    return costs


def alternation(target: backend.LlamaCppNetwork, draft: backend.LlamaCppNetwork) -> tuple[float, float]:
    """Median ms of a draft 1-token decode and a target 5-token decode when they alternate."""
    caches = [net.new_cache(4096, 1) for net in (target, draft)]
    for net, cache in zip((target, draft), caches, strict=True):
        net(CONTEXT, torch.arange(64), cache, Attention.chain(64))
        cache.commit(0, 64)
    draft_times, target_times = [], []
    for _ in range(6):
        for i in range(4):
            began = time.perf_counter()
            draft(
                torch.tensor([2000 + i]), torch.tensor([64 + i]), caches[1], Attention.chain(1, batch_invariant=False)
            )
            caches[1].commit(0, 1)
            draft_times.append(time.perf_counter() - began)
        caches[1].rollback(0, 64)
        began = time.perf_counter()
        target(torch.arange(2000, 2005), torch.arange(64, 69), caches[0], Attention.chain(5))
        target_times.append(time.perf_counter() - began)
        caches[0].crop(0)
    return statistics.median(draft_times) * 1000, statistics.median(target_times) * 1000


def python_costs(net: backend.LlamaCppNetwork) -> dict[str, float]:
    """ms per 5-position verify block of what happens outside llama_decode."""

    def per_call(work) -> float:
        began = time.perf_counter()
        for _ in range(20):
            work()
        return round((time.perf_counter() - began) / 20 * 1000, 2)

    raw = np.ctypeslib.as_array(net.lib.llama_get_logits(net.context), shape=(5, net.vocab_size))
    logits = torch.from_numpy(raw.copy())
    sampling = SamplingParams(temperature=0.8)
    return {
        "copy logits": per_call(lambda: torch.from_numpy(raw.copy())),
        "argmax": per_call(lambda: logits.argmax(-1)),
        "probabilities at t=0.8": per_call(lambda: logits_to_probs(logits, sampling)),
    }


def decode_share(target_path: str, draft_path: str) -> dict[str, float]:
    """Seconds of 64 greedy tokens per method, and the share spent inside llama_decode."""
    from specdec import SpeculativeDecoder, load

    target, draft = load(target_path), load(draft_path)
    inside = [0.0]
    decode = backend.LlamaCppNetwork.decode

    def timed(self, *args):
        began = time.perf_counter()
        try:
            return decode(self, *args)
        finally:
            inside[0] += time.perf_counter() - began

    backend.LlamaCppNetwork.decode = timed
    shares = {}
    for name, drafter in (("target-only", None), ("model:fixed", draft)):
        decoder = SpeculativeDecoder(target, drafter, gamma=4)
        decoder.generate("def quicksort(items):", max_new_tokens=4)  # warm up
        inside[0], began = 0.0, time.perf_counter()
        decoder.generate("def quicksort(items):", max_new_tokens=64, temperature=0.0)
        total = time.perf_counter() - began
        shares[name] = (round(total, 2), round(inside[0] / total, 3))
    backend.LlamaCppNetwork.decode = decode
    return shares


def main(target_path: str, draft_path: str) -> None:
    for repacked in (False, True):
        for path in (target_path, draft_path):
            costs = block_costs(network(path, repacked))
            print(f"{path.rsplit('/', 1)[-1]}, {'repacked' if repacked else 'plain ggml'}: k -> (ms, max diff) {costs}")
    target, draft = network(target_path, False), network(draft_path, False)
    print("alternating: draft T(1) %.1f ms, target T(5) %.1f ms" % alternation(target, draft))
    print("outside llama_decode, per 5-token block (ms):", python_costs(target))
    print("64 greedy tokens: method -> (seconds, share inside llama_decode)", decode_share(target_path, draft_path))


if __name__ == "__main__":
    main(*sys.argv[1:3])
