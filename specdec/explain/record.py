"""One generation with every verify step recorded: what the engine already knows, kept.

StepRecorder is the engine's verify hook (Engine(verify_hook=...)): the speculative loop is the
engine's own, untouched. A sampled step's record keeps the rejection sampler's own decision (its
acceptance tests, uniforms and final distribution, specdec.core.verify.RejectionDecision), so what
explain shows is what the sampler did, not a replay of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.assembly import engine_of
from specdec.core.drafts import Draft, Drafter, block_depths, block_parents
from specdec.core.engine import Engine, Request
from specdec.core.policy import DraftLengthPolicy
from specdec.core.request import VerifyHook
from specdec.core.sampling import SamplingParams, logits_to_probs
from specdec.core.verify import RejectionDecision, point_mass_probs
from specdec.core.verify_batch import Verdict
from specdec.decoder import GenerationResult, SpeculativeDecoder
from specdec.models.base import LanguageModel, tree_visibility


@dataclass
class StepRecord:
    """One verify step of one request, as the engine saw it."""

    index: int  # 1-based step number
    context_length: int  # tokens in the context before the step
    block_tokens: list[int]  # the verify block: [last context token, drafted tokens...]
    parents: tuple[int, ...] | None  # the drafted tree (None: a chain)
    positions: list[int]  # each block token's position
    mask: torch.Tensor  # [gamma + 1, gamma + 1] bool: block token i attends to block token j (and all the context)
    q: torch.Tensor | None  # chain [gamma, vocab] / tree [gamma + 1, vocab]; None: point masses or greedy
    p: torch.Tensor  # [gamma + 1, vocab], the target's processed distributions over the block
    greedy: bool
    decision: RejectionDecision | None  # the rejection sampler's tests (sampling only)
    emitted: list[int] = field(default_factory=list)
    path: list[int] | None = None  # accepted tree nodes (None: a chain)
    from_cache: tuple[bool, ...] | None = None  # per draft node: copied from earlier requests' outputs
    drafter: str | None = None  # the auto drafter's choice this step (None: another drafter)
    relaxed: list[int] = field(default_factory=list)  # accepted nodes the exact test rejected (LOSSY acceptance)
    draft_ms: float = 0.0  # drafting this step (the draft model's forwards, or a lookup)
    verify_ms: float = 0.0  # the target's one forward over the block, and verification

    @property
    def draft_tokens(self) -> list[int]:
        return self.block_tokens[1:]

    @property
    def gamma(self) -> int:
        return len(self.block_tokens) - 1

    @property
    def num_accepted(self) -> int:
        return len(self.emitted) - 1

    @property
    def rejected(self) -> bool:
        """A draft token was turned down (a chain or tree step that kept fewer than it drafted
        along its path and ended on a correction)."""
        if self.parents is None:
            return self.num_accepted < self.gamma
        end = self.path[-1] if self.path else -1
        return end in set(self.parents)  # the last node still had children: they were rejected

    def draft_probs(self) -> torch.Tensor:  # [gamma, vocab] for a chain
        """q as the verifier used it: the drafter's rows, or point masses on its guesses."""
        if self.q is not None:
            return self.q
        tokens = torch.tensor(self.draft_tokens, dtype=torch.long)
        return point_mass_probs(tokens, self.p.shape[-1]).to(self.p.dtype)


def verify_mask(draft: Draft) -> torch.Tensor:  # [gamma + 1, gamma + 1] bool
    """Who sees whom inside the verify block (every block token also sees the whole context)."""
    parents = block_parents(draft)
    if parents is None:
        return torch.ones(draft.num_nodes + 1, draft.num_nodes + 1, dtype=torch.bool).tril()
    return tree_visibility(parents)


class StepRecorder:
    """The engine's verify hook: a StepRecord per verified step (of a single request)."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def __call__(self, request: Request, draft: Draft, target_logits: torch.Tensor,  # [nodes + 1, vocab]
                 verdict: Verdict, draft_seconds: float, verify_seconds: float) -> None:
        length, sampling = request.length, request.sampling
        self.records.append(StepRecord(
            index=len(self.records) + 1, context_length=length,
            block_tokens=[int(request.tokens[length - 1])] + draft.tokens.tolist(), parents=draft.parents,
            positions=[length - 1 + depth for depth in block_depths(draft)], mask=verify_mask(draft),
            q=None if draft.probs is None else draft.probs.detach().cpu(),
            p=logits_to_probs(target_logits, sampling).cpu(), greedy=sampling.greedy, decision=verdict.decision,
            emitted=verdict.emitted.tolist(), path=None if verdict.path is None else verdict.path.tolist(),
            from_cache=draft.from_cache, drafter=draft.drafter, relaxed=list(verdict.relaxed),
            draft_ms=draft_seconds * 1000, verify_ms=verify_seconds * 1000))


@dataclass(frozen=True)
class ChainDecision:
    """A chain step's verification: Leviathan et al.'s Algorithm 1 in the open."""

    acceptance: list[float]  # min(1, p(x_i) / q(x_i)) for each drafted x_i
    uniforms: list[float]  # u_i: x_i is accepted when u_i < acceptance_i
    num_accepted: int  # drafts kept before the first rejection
    final_dist: torch.Tensor  # [vocab]: norm(max(0, p - q)) after a rejection, else p after the last draft
    final_token: int  # drawn from final_dist (greedy: the target's argmax)


def chain_decision(record: StepRecord) -> ChainDecision:
    """A chain step's decision: the sampler's own (recorded), or greedy's comparison of argmaxes
    (nothing is drawn). The drafts a LOSSY acceptance rule kept are the record's."""
    if record.parents is not None:
        raise ValueError("chain_decision takes chain steps; this one drafted a tree")
    gamma, p, accepted = record.gamma, record.p, record.num_accepted
    if record.decision is not None:
        decision = record.decision
        return ChainDecision(decision.acceptance.tolist(), decision.uniforms.tolist(), accepted,
                             decision.final_dist.cpu(), record.emitted[-1])
    if not record.greedy:
        raise ValueError("a sampled step recorded without the sampler's decision (the coupled rule?)")
    matches = (torch.tensor(record.draft_tokens, dtype=torch.long) == p.argmax(-1)[:gamma]).float()
    matches[record.relaxed] = 1.0
    return ChainDecision(matches.tolist(), [], accepted, p[accepted], int(p[accepted].argmax()))


@dataclass
class RecordedRun:
    result: GenerationResult
    records: list[StepRecord]
    sampling: SamplingParams


def record_generation(target: LanguageModel, drafter: Drafter | LanguageModel | None, prompt: str | list[int],
                      sampling: SamplingParams, gamma: int = 4, policy: str | DraftLengthPolicy = "fixed",
                      warm_up: bool = False) -> RecordedRun:
    """record_run of an engine with ``drafter`` (a Drafter or a draft model), ``gamma`` and ``policy``."""
    return record_run(lambda hook: engine_of(target, drafter, gamma, policy, verify_hook=hook), prompt, sampling,
                      warm_up)


def record_run(make_engine: Callable[[VerifyHook], Engine], prompt: str | list[int], sampling: SamplingParams,
               warm_up: bool = False) -> RecordedRun:
    """Generate once with every step recorded (the decoder's own loop on the engine ``make_engine``
    builds with the recorder as its verify hook). warm_up: first a two-token generation, so the
    first recorded step's times are not those of the models' first calls (hundreds of ms). Sampled
    steps run rejection sampling, whose tests a record keeps (the coupled rule's decisions are the
    target's own draws: nothing to show)."""
    if sampling.sampling_rule == "coupled":
        raise ValueError("explain shows rejection sampling's draws; it does not explain the coupled sampling rule")
    sampling = dataclasses.replace(sampling, sampling_rule="rejection")
    recorder = StepRecorder()
    decoder = SpeculativeDecoder.from_engine(make_engine(recorder))
    if warm_up:
        decoder.generate(prompt, dataclasses.replace(sampling, max_new_tokens=2))
        recorder.records.clear()
    result = decoder.generate(prompt, sampling)
    assert isinstance(result, GenerationResult)  # one prompt, one result
    return RecordedRun(result, recorder.records, sampling)


def chosen_step(records: list[StepRecord], step: int | None) -> StepRecord:
    """Step ``step`` (1-based), or by default the first with a rejection (else the first)."""
    if not records:
        raise ValueError("the generation made no verify steps")
    if step is not None:
        if not 1 <= step <= len(records):
            raise ValueError(f"--step must be in 1..{len(records)} (this run made {len(records)} steps), got {step}")
        return records[step - 1]
    return next((record for record in records if record.rejected), records[0])
