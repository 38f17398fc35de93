"""What verifying a step costs once the target's forward is done: the one pass over the ragged batch
(specdec/core/verify_batch.py verify_step) against a call per request (verify_batch.verify_request, what
a step did before), on random logits of a real vocabulary, chains of gamma drafted tokens, greedy and
rejection-sampled (temperature 0.8, top-p 0.95), for several batch sizes; the median of repeats,
both sides in one run. The verdicts are checked equal before anything is timed.

    python benchmarks/serve/verify_batch.py [--vocab 49152] [--gamma 4] [--batches 1 8 32]
        [--device cpu] [--repeats 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from specdec.bench.suite import machine_description
from specdec.core.drafts import Draft
from specdec.core.rules import RejectionRule
from specdec.core.sampling import SamplingParams, logits_to_probs
from specdec.core.verify_batch import verify_request, verify_step


def step_inputs(batch: int, gamma: int, vocab: int, sampling: SamplingParams, device: str, seed: int):
    source = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(batch * (gamma + 1), vocab, generator=source, device=device) * 3  # [rows, vocab]
    requests, drafts = [], []
    for row in range(batch):
        draft_logits = logits[row * (gamma + 1): row * (gamma + 1) + gamma] + torch.randn(
            gamma, vocab, generator=source, device=device)  # q near p, so that drafts get accepted
        probs = logits_to_probs(draft_logits, sampling)
        tokens = probs.argmax(-1) if sampling.greedy else torch.multinomial(probs, 1, generator=source)[:, 0]
        drafts.append(Draft(tokens, None if sampling.greedy else probs))
        generator = torch.Generator(device=device).manual_seed(seed + row)
        requests.append(SimpleNamespace(sampling=sampling, rule=RejectionRule(generator), generator=generator,
                                        length=16))
    return requests, drafts, logits


def run(batch: int, gamma: int, vocab: int, sampling: SamplingParams, device: str, repeats: int) -> dict:
    offsets = list(range(0, batch * (gamma + 1) + 1, gamma + 1))
    timings: dict[str, list[float]] = {"per request": [], "one pass": []}
    verdicts = {}
    for repeat in range(repeats + 1):  # the first is a warm-up
        for side in timings:
            requests, drafts, logits = step_inputs(batch, gamma, vocab, sampling, device, seed=repeat)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            argmax = logits.argmax(-1) if sampling.greedy else None
            if side == "one pass":
                out = verify_step(requests, drafts, logits, argmax, offsets)
            else:
                out = [verify_request(r, d, logits[a:b], None if argmax is None else argmax[a:b])
                       for r, d, a, b in zip(requests, drafts, offsets, offsets[1:], strict=False)]
            emitted = [verdict.emitted.tolist() for verdict in out]  # the host sync a step makes
            if repeat:
                timings[side].append(time.perf_counter() - started)
            verdicts[side] = emitted
        if verdicts["one pass"] != verdicts["per request"]:
            raise AssertionError(f"verdicts differ at batch {batch}, repeat {repeat}")
    return {side: 1000 * statistics.median(values) for side, values in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="runs/verify_batch.json")
    args = parser.parse_args()
    rows = []
    for name, sampling in (("greedy", SamplingParams()),
                           ("rejection t=0.8 top-p 0.95", SamplingParams(temperature=0.8, top_p=0.95))):
        for batch in args.batches:
            ms = run(batch, args.gamma, args.vocab, sampling, args.device, args.repeats)
            rows.append({"sampling": name, "batch": batch, "per_request_ms": ms["per request"],
                         "one_pass_ms": ms["one pass"]})
            print(f"{name:28s} batch {batch:3d}: per request {ms['per request']:8.2f} ms, "
                  f"one pass {ms['one pass']:8.2f} ms ({ms['per request'] / ms['one pass']:.2f}x)")
    result = {"machine": machine_description(), "device": args.device, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "vocab": args.vocab, "gamma": args.gamma, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
