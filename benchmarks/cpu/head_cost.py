"""A draft head's cost per draft token as a fraction of the target's T(1), on this machine.

    python benchmarks/cpu/head_cost.py --head DIR [--target DIR] [--quantize int8|int4|w8a32|none]
        [--head-quantize auto|none|int8|int4] [--out FILE.json]

Times, after a 200-token context (medians of --repeats): the target's one-token forward T(1), one
greedy chain draft step of the head (a one-token head forward and the pick of its token, as
HeadDrafter does: the argmax over the draft vocabulary, mapped to the target's id) and one greedy
tree depth of 4 nodes (4 nodes' forward, the softmax over the draft vocabulary and each node's top
4), each also as the head's forward alone (the rest is the pick); for a head with packed linears,
both its compiled layer calls and the torch layer, interleaved. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specdec import load
from specdec.drafting import load_head
from specdec.drafting.head_drafter import HeadDrafter
from specdec.drafting.head_format import head_quantization
from specdec.machine import isa_summary, write_measurement
from specdec.models.base import Attention, Segment
from specdec.models.timing import prefilled_cache, time_block


def median_seconds(run, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True)
    parser.add_argument("--target", help="default: the default pair's target")
    parser.add_argument("--quantize", default="int8", choices=["int8", "int4", "w8a32", "none"])
    parser.add_argument("--head-quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                        help="the head's linears (auto: as the drafters load it, like the target)")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="runs/head-cost.json")
    args = parser.parse_args()
    if args.target is None:
        from specdec.defaults import default_pair

        args.target = str(default_pair().target)
    target = load(args.target, quantize=None if args.quantize == "none" else args.quantize)
    head_quantize = {"auto": head_quantization(target), "none": None}.get(args.head_quantize, args.head_quantize)
    heads = {"compiled": load_head(args.head, target, quantize=head_quantize),
             "torch": load_head(args.head, target, quantize=head_quantize, compiled=False)}
    if heads["compiled"].norm_then_head is None:  # not packed, or the compiled layer fails its check here
        del heads["compiled"]
    t1 = time_block(target, prefilled_cache(target, 1, args.context), 1, args.repeats)
    steps = {name: head_steps(head, target, args.context) for name, head in heads.items()}
    times: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in timed} for name, timed in steps.items()}
    for _ in range(5):  # interleaved rounds: the machine's drift touches both alike
        for name, timed in steps.items():
            for kind, run in timed.items():
                times[name][kind].append(median_seconds(run, args.repeats))
    result: dict = {"target": target.name, "quantize": args.quantize, "head": str(args.head),
                    "head_quantize": head_quantize, "draft_vocab": next(iter(heads.values())).config.draft_vocab_size,
                    "target_T1_ms": 1000 * t1, "layers": {}}
    print("| head layer | target T(1) ms | head chain step ms | of which the head's forward | c = step / T(1) "
          "| tree depth of 4 nodes ms | of which the head's forward | / T(1) |\n|---|---|---|---|---|---|---|---|")
    for name, measured in times.items():
        ms = {kind: 1000 * statistics.median(samples) for kind, samples in measured.items()}
        result["layers"][name] = {"head_chain_step_ms": ms["chain"], "head_chain_forward_ms": ms["chain_forward"],
                                  "head_tree_depth4_ms": ms["tree"], "head_tree_forward_ms": ms["tree_forward"],
                                  "chain_step_over_T1": ms["chain"] / 1000 / t1,
                                  "tree_depth4_over_T1": ms["tree"] / 1000 / t1}
        print(f"| {name} | {1000 * t1:.2f} | {ms['chain']:.2f} | {ms['chain_forward']:.2f} | "
              f"{ms['chain'] / 1000 / t1:.3f} | {ms['tree']:.2f} | {ms['tree_forward']:.2f} | "
              f"{ms['tree'] / 1000 / t1:.3f} |")
    write_measurement(args.out, result)
    print(f"wrote {args.out} ({isa_summary()})")


def head_steps(head, target, context_length: int) -> dict[str, Callable[[], object]]:
    """One chain draft step and one tree depth of 4 nodes of ``head`` as the drafters run them for
    one request (batch-invariant, as every draft is), after a fed context, and the head's forward
    of each alone."""
    drafter = HeadDrafter(head, target.max_context)
    context = torch.arange(context_length) % target.vocab_size
    state = drafter.start(context)
    state.queue(context, torch.randn(context_length, head.config.feature_size))
    drafter.feed([state])
    token, position = torch.tensor([5]), torch.tensor([state.fed])

    def chain_forward():
        return head(token, state.root_features, position, drafter.cache, Attention.chain(1, state.row))[0]

    def chain_step():
        return drafter.columns.token_ids[chain_forward().argmax(-1)].tolist()

    nodes = torch.tensor([5, 6, 7, 8])
    segment = Segment(state.row, 4, (-1, -1, -1, -1))

    def tree_forward():
        return head(nodes, state.root_features.expand(4, -1), position.expand(4), drafter.cache,
                    Attention((segment,)))[0]

    def tree_depth():
        return drafter.columns.token_ids[tree_forward().softmax(-1).topk(4, dim=-1).indices].tolist()

    return {"chain": chain_step, "chain_forward": chain_forward, "tree": tree_depth, "tree_forward": tree_forward}


if __name__ == "__main__":
    main()
