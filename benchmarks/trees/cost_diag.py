"""Which gammas does the cost policy pick on the real int8 pair, and what T(k) did it measure?

    python benchmarks/trees/cost_diag.py [MODELS_DIR] [--target DIR] [--draft DIR]

MODELS_DIR is the folder ../shared/real-models/fetch.sh filled (qwen2.5-coder-1.5b and -0.5b in
it); --target and --draft name other folders. Two generations with the staged drafter under the
cost policy (specdec.core.policy.CostModelPolicy) on the engine's one cost model
(specdec.core.estimates.CostModel); after each: the depths the policy asked for, T(k) as measured
(batch 1) and as fitted, the draft's seconds per token, the acceptance estimates and the expected
tokens per second of each gamma.
"""

from __future__ import annotations

import collections

from real_pair import PROMPT, load_pair, pair_parser  # (this folder: the script's own path comes first)

from specdec import SpeculativeDecoder
from specdec.core.estimates import CostModel, tokens_per_second
from specdec.core.policy import CostModelPolicy, DraftShape
from specdec.drafting import make_drafter


class WatchedCostPolicy(CostModelPolicy):
    """The cost policy, counting the depth it asked for at each step and keeping its last request's copy."""

    chosen: collections.Counter[int] = collections.Counter()
    last: CostModelPolicy | None = None

    def for_request(self) -> CostModelPolicy:
        copy = WatchedCostPolicy(self.gamma, self.max_gamma, costs=self.costs)
        WatchedCostPolicy.last = copy
        return copy

    def update(self, asked: DraftShape, num_drafted: int, num_accepted: int, draft_seconds: float,
               widths: list[int] | None = None) -> None:
        WatchedCostPolicy.chosen[asked.depth] += 1
        super().update(asked, num_drafted, num_accepted, draft_seconds, widths)


def main() -> None:
    parser = pair_parser(__doc__.splitlines()[0], max_new_tokens=64)
    args = parser.parse_args()
    target, draft = load_pair(args)
    costs = CostModel()
    decoder = SpeculativeDecoder(target, make_drafter("staged", draft, target=target), gamma=4,
                                 policy=WatchedCostPolicy(gamma=4, costs=costs), costs=costs)
    for _ in range(2):
        decoder.generate(PROMPT, max_new_tokens=args.max_new_tokens)
        policy = WatchedCostPolicy.last
        assert policy is not None  # every request takes a copy
        print("gammas", sorted(WatchedCostPolicy.chosen.items()))
        WatchedCostPolicy.chosen.clear()
        measured = {block: cell for (batch, block), cell in sorted(costs.verify.cells.items()) if batch == 1}
        print("T(k) ms", {k: round((cell.mean or 0.0) * 1000, 1) for k, cell in measured.items()},
              "counts", {k: round(cell.count, 1) for k, cell in measured.items()})
        curve = costs.verify.curve(1)
        if curve is not None:
            print("fit ms", {k: round(curve(k) * 1000, 1) for k in range(1, 14)})
        draft_seconds = costs.draft().seconds()
        print("draft ms/token", None if draft_seconds is None else round(draft_seconds * 1000, 1),
              "acceptance", [round(a, 2) for a in policy.acceptance.alphas()])
        rates = {g: tokens_per_second(policy.acceptance.expected_tokens(g), g, draft_seconds,
                                      None if curve is None else curve(g + 1)) for g in range(policy.max_gamma + 1)}
        print("rates", {g: round(rate or 0.0, 2) for g, rate in rates.items()})


if __name__ == "__main__":
    main()
