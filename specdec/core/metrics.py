"""SpecStats: what happened during one generation, in the project's notation.

alpha = accepted / drafted; tau = tokens emitted per target forward (accepted drafts plus the
target's own token), so plain decoding has tau = 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0  # verification forwards (the prefill is not counted)
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # [i]: steps that drafted position (tree depth) i
    accepted_at: list[int] = field(default_factory=list)  # [i]: steps that accepted position (tree depth) i
    tree_nodes_at: list[int] = field(default_factory=list)  # [i]: tree nodes drafted at depth i, all steps
    # A draft with another tokenizer: tokens it drafted in its own vocabulary, and those whose
    # text reached the target tokens it proposed (`drafted` counts target tokens).
    source_drafted: int = 0
    source_kept: int = 0
    # Suffix drafters: drafted / accepted tokens guessed from earlier requests' outputs (not this request's text).
    drafted_from_cache: int = 0
    accepted_from_cache: int = 0
    # Constrained requests: steps that drafted the grammar's forced tokens, and those tokens (not in drafted / accepted)
    forced_steps: int = 0
    forced_tokens: int = 0
    # in the grammar engine: masks along each draft, forced tokens, advancing (inside draft / verify seconds)
    grammar_seconds: float = 0.0
    # An auto drafter's choices: candidate name ("none": no draft) -> [steps, drafted, accepted]
    by_drafter: dict[str, list[int]] = field(default_factory=dict)
    # The request's acceptance (SamplingParams.acceptance): anything but "exact" is LOSSY, and
    # relaxed_accepted counts the accepted drafts that the exact test rejected (in `accepted` too)
    acceptance: str = "exact"
    relaxed_accepted: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forward + verification
    total_seconds: float = 0.0

    def observe(self, num_drafted: int, num_accepted: int, tree_widths: list[int] | None = None,
                drafter: str | None = None) -> None:
        """Record one speculative step (for a tree: num_drafted nodes, tree_widths[d] of them at
        depth d, and num_accepted the length of the accepted path; ``drafter``: which of an auto
        drafter's candidates drafted it)."""
        self.target_forwards += 1
        if drafter is not None:
            counts = self.by_drafter.setdefault(drafter, [0, 0, 0])
            counts[0] += 1
            counts[1] += num_drafted
            counts[2] += num_accepted
        self.drafted += num_drafted
        self.accepted += num_accepted
        depth = num_drafted if tree_widths is None else len(tree_widths)
        if depth > len(self.drafted_at):
            grow = depth - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for position in range(depth):
            self.drafted_at[position] += 1
            self.accepted_at[position] += position < num_accepted
        if tree_widths is not None:
            self.tree_nodes_at += [0] * (len(tree_widths) - len(self.tree_nodes_at))
            for position, width in enumerate(tree_widths):
                self.tree_nodes_at[position] += width

    def observe_forced(self, count: int) -> None:
        """One step that drafted ``count`` tokens the grammar forced (all accepted)."""
        self.target_forwards += 1
        self.forced_steps += 1
        self.forced_tokens += count

    def observe_translation(self, proposed: int, kept: int) -> None:
        self.source_drafted += proposed
        self.source_kept += kept

    def observe_cache(self, drafted: int, accepted: int) -> None:
        self.drafted_from_cache += drafted
        self.accepted_from_cache += accepted

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    @property
    def mean_tree_width(self) -> list[float]:
        """Mean number of tree nodes at each depth, over the steps that reached it."""
        return [n / d if d else 0.0 for n, d in zip(self.tree_nodes_at, self.drafted_at, strict=False)]

    def drafter_summary(self) -> str:
        """The auto drafter's choices in words: "suffix 12 steps (30/41 accepted), none 3 steps"."""
        return ", ".join(f"{name} {steps} steps" + (f" ({accepted}/{drafted} accepted)" if drafted else "")
                         for name, (steps, drafted, accepted) in sorted(self.by_drafter.items(),
                                                                        key=lambda item: -item[1][0]))

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.prefill_seconds - self.draft_seconds - self.verify_seconds)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over the whole wall time of the generation, prefill included."""
        return self.generated_tokens / self.total_seconds if self.total_seconds else 0.0

    def merge(self, other: SpecStats) -> SpecStats:
        """Sum of two runs' counts and times (for benchmark aggregates)."""
        merged = SpecStats()
        for name, value in asdict(self).items():
            theirs = getattr(other, name)
            if isinstance(value, dict):
                value = {name: [a + b for a, b in zip(value.get(name, [0, 0, 0]), theirs.get(name, [0, 0, 0]),
                                                      strict=True)]
                         for name in {**value, **theirs}}
                setattr(merged, name, value)
            elif isinstance(value, str):  # the runs' acceptance settings, each once
                setattr(merged, name, " | ".join(dict.fromkeys([*value.split(" | "), *theirs.split(" | ")])))
            elif isinstance(value, list):
                size = max(len(value), len(theirs))
                value = [(value + [0] * size)[i] + (theirs + [0] * size)[i] for i in range(size)]
                setattr(merged, name, value)
            else:
                setattr(merged, name, value + theirs)
        return merged

    @property
    def prediction_tokens(self) -> tuple[int, int]:
        """(accepted, rejected) tokens drafted from the request's prediction (OpenAI's
        accepted_prediction_tokens / rejected_prediction_tokens)."""
        _, drafted, accepted = self.by_drafter.get("prediction", (0, 0, 0))
        return accepted, drafted - accepted

    def to_dict(self) -> dict:
        accepted_prediction, rejected_prediction = self.prediction_tokens
        return {
            "accepted_prediction_tokens": accepted_prediction,
            "rejected_prediction_tokens": rejected_prediction,
            **asdict(self),
            "lossy": self.acceptance != "exact",
            "alpha": self.alpha,
            "tau": self.tau,
            "acceptance_by_position": self.acceptance_by_position,
            "mean_tree_width": self.mean_tree_width,
            "other_seconds": self.other_seconds,
            "tokens_per_second": self.tokens_per_second,
        }

