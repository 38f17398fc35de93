"""Draft seconds per step as a function of the drafted length (staged and model drafters, real int8 pair).

    python benchmarks/trees/draft_cost_diag.py [MODELS_DIR] [--target DIR] [--draft DIR]

MODELS_DIR is the folder ../shared/real-models/fetch.sh filled (qwen2.5-coder-1.5b and -0.5b in
it); --target and --draft name other folders. For each drafter and fixed gamma, one generation;
printed: per drafted length, the steps and their mean draft milliseconds (the first step of each
length left out: the first step also feeds the drafter the prompt), as the engine hands them to
the policy's update.
"""

from __future__ import annotations

import collections

from real_pair import PROMPT, load_pair, pair_parser  # (this folder: the script's own path comes first)

from specdec import SpeculativeDecoder
from specdec.core.policy import DraftShape, FixedPolicy
from specdec.drafting import make_drafter


class RecordingPolicy(FixedPolicy):
    """A fixed gamma that records each step's draft seconds by the number of tokens drafted."""

    def __init__(self, gamma: int, seen: dict[int, list[float]]) -> None:
        super().__init__(gamma)
        self.seen = seen

    def for_request(self) -> RecordingPolicy:
        return RecordingPolicy(self.gamma, self.seen)  # one record for every request

    def update(self, asked: DraftShape, num_drafted: int, num_accepted: int, draft_seconds: float,
               widths: list[int] | None = None) -> None:
        self.seen[num_drafted].append(draft_seconds)


def main() -> None:
    parser = pair_parser(__doc__.splitlines()[0], max_new_tokens=48)
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    target, draft = load_pair(args)
    for kind in ("model", "staged"):
        for gamma in args.gammas:
            seen: dict[int, list[float]] = collections.defaultdict(list)
            decoder = SpeculativeDecoder(target, make_drafter(kind, draft, target=target), gamma=gamma,
                                         policy=RecordingPolicy(gamma, seen))
            decoder.generate(PROMPT, max_new_tokens=args.max_new_tokens)
            print(kind, gamma, {k: (len(v), round(1000 * sum(v[1:]) / max(1, len(v) - 1), 1))
                                for k, v in sorted(seen.items())}, flush=True)


if __name__ == "__main__":
    main()
