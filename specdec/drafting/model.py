"""A smaller language model as the drafter."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdec.drafting.base import BaseDrafter, Draft, DraftRequest, StepOutcome
from specdec.drafting.lockstep import DraftSteps, run_alone
from specdec.models.base import LanguageModel
from specdec.sampling import SamplingParams, logits_to_probs


class DraftModelState:
    """One request's draft-model cache, and the context tokens not yet fed to it.

    Invariant: the cache's committed tokens followed by ``pending`` are the request's context
    (while drafting, the drafted tokens fed so far follow the context in the cache). observe()
    keeps the entries of accepted drafts and queues the rest of what was emitted: no diffing.
    """

    def __init__(self, model: LanguageModel, prompt_ids: torch.Tensor) -> None:  # prompt_ids [n]
        self.model = model
        self.cache = model.new_cache()
        self.pending = prompt_ids  # [m] int64
        self.drafted: list[int] = []  # the last draft's tokens; the cache holds a prefix of them

    def room(self, context_length: int) -> int:
        """How many tokens can still be drafted after context_length (the cache will hold the
        context plus all drafted tokens but the last)."""
        return self.model.max_context - context_length + 1

    def start_draft(self, context_length: int, gamma: int) -> int:
        """gamma clamped to the room left, with the cache reserved for it; 0 = draft nothing."""
        gamma = min(gamma, self.room(context_length))
        if gamma > 0:
            self.cache.reserve(context_length + gamma)
        return max(gamma, 0)

    def feed_pending(self) -> torch.Tensor:  # -> logits [1, vocab] after the whole context
        """Feed the context tokens the cache lacks (at least the last one: its logits give q
        for the first draft token)."""
        logits = self.forward(self.pending)[-1:]
        self.pending = self.pending[:0]
        return logits

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [k] -> logits [k, vocab]
        return self.model.extend(tokens, self.cache, batch_invariant=False)  # a draft needs no exactness

    def observe(self, context_length: int, emitted: torch.Tensor) -> None:
        """The context now has context_length tokens, the last len(emitted) of them new."""
        before = context_length - emitted.shape[0]  # the context's length when the step began
        fed = self.cache.lengths[0]
        if fed < before:  # nothing was drafted: the cache did not move
            self.pending = torch.cat([self.pending, emitted])
            return
        # Cache entries past `before` hold this drafter's own tokens (self.drafted, in order);
        # those the target accepted stay. (Another drafter's branch may have won: compare.)
        in_cache = self.drafted[: fed - before]
        agree = common_prefix(in_cache, emitted[:-1].tolist())
        self.cache.rollback(0, before + agree)
        self.pending = emitted[agree:]

    def rewind(self, context: torch.Tensor, kept: int) -> None:  # context [n] int64
        """The context is now ``context``, of which only the first ``kept`` tokens are known to
        match what was fed (a translating drafter re-tokenizes the tail of its context): the
        cache keeps at most those, and the rest of the context is queued (at least the last
        token, whose logits give q for the next draft)."""
        fed = max(0, min(self.cache.lengths[0], kept, context.shape[0] - 1))
        self.cache.rollback(0, fed)
        self.pending = context[fed:]


def common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens the two sequences share."""
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count


def sample_from_logits(
    logits: torch.Tensor,  # [1, vocab]
    request: DraftRequest,
    position: int,  # the output position of the drawn token
) -> tuple[torch.Tensor, torch.Tensor | None]:  # token [1], q [1, vocab] (None when greedy)
    if request.sampling.greedy:  # greedy verification needs no q: skip building it
        return logits.argmax(-1), None
    probs = logits_to_probs(logits, request.sampling)
    return request.rule.draw(probs, [position]), probs


def token_confidence(
    logits: torch.Tensor,  # [1, vocab]
    probs: torch.Tensor | None,  # [1, vocab], q (None when greedy)
    token: torch.Tensor,  # [1]
    sampling: SamplingParams,
) -> float:
    """The draft's probability of its token: q(token), or the plain softmax when greedy (where q
    would be a point mass and says nothing about how sure the draft is)."""
    source = logits.float().softmax(-1) if sampling.greedy else probs
    return float(source[0, token])


def draft_chain(
    logits: torch.Tensor,  # [1, vocab]: the draft's logits for the first token
    next_logits: Callable[[torch.Tensor], torch.Tensor],  # tokens [k] -> logits [1, vocab] after the last
    gamma: int,
    request: DraftRequest,
) -> Draft:
    """chain_steps for one request, each block scored by ``next_logits``."""
    return run_alone(chain_steps(logits, gamma, request), next_logits)


def chain_steps(
    logits: torch.Tensor,  # [1, vocab]: the draft's logits for the first token
    gamma: int,
    request: DraftRequest,
) -> DraftSteps[torch.Tensor]:  # yields token blocks [k], is sent the logits [1, vocab] after each block's last
    """Up to gamma tokens, one at a time, each drawn from q (or the argmax when greedy); the
    request's policy may stop it early (stop_early, on the chain's probability under the draft).
    A constrained request's q is masked to what its grammar allows along the chain (the matcher
    walks the chain and is rolled back), so the draft never proposes a token the target's masked
    p must reject; where the grammar forces tokens, they join the chain without a draw (q a point
    mass, as the masked p is there) and the draft reads them in one forward. A generator
    (drafting/lockstep.py), so that a batch of requests can draft in lockstep."""
    sampling, stop_early, matcher = request.sampling, request.stop_early, request.matcher
    first_position = request.context.shape[0]
    tokens, probs, chain_probability = [], [], 1.0
    try:
        while True:
            forced = matcher.forced()[: gamma - len(tokens)] if matcher is not None and matcher.draft_forced else []
            if forced:
                block = torch.tensor(forced, dtype=torch.long, device=logits.device)
                tokens += list(block[:, None])
                if not sampling.greedy:
                    probs.append(torch.zeros(len(forced), logits.shape[-1], device=logits.device).scatter_(
                        -1, block[:, None], 1.0))
                if not all(matcher.look_ahead(token) for token in forced) or len(tokens) == gamma:
                    break
                logits = yield block
                continue
            if matcher is not None:
                logits = matcher.mask_draft_logits(logits)
            token, step_probs = sample_from_logits(logits, request, first_position + len(tokens))
            tokens.append(token)
            if step_probs is not None:
                probs.append(step_probs)
            if len(tokens) == gamma or (matcher is not None and not matcher.look_ahead(int(token))):
                break
            if stop_early is not None:
                chain_probability *= token_confidence(logits, step_probs, token, sampling)
                if stop_early(len(tokens), chain_probability):
                    break
            logits = yield token
    finally:
        if matcher is not None:
            matcher.end_look_ahead()
    return Draft(torch.cat(tokens), torch.cat(probs) if probs else None)


class DraftModelDrafter(BaseDrafter):
    """What every drafter built on a draft model shares: one DraftModelState per request, and
    observe() keeping the cache entries of the accepted drafts."""


    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.vocab_size = model.vocab_size

    def start(self, prompt_ids: torch.Tensor) -> DraftModelState:
        return DraftModelState(self.model, prompt_ids)

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        request.draft_state.observe(request.context.shape[0], outcome.emitted)


class ModelDrafter(DraftModelDrafter):
    """Drafts a chain autoregressively with its own model and a KV cache per request."""

    def describe(self) -> str:
        return f"draft model {self.model.name}"

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        state: DraftModelState = request.draft_state
        context = request.context
        gamma = state.start_draft(context.shape[0], gamma)
        if gamma == 0:
            return Draft.empty(context.device)
        draft = draft_chain(state.feed_pending(), lambda tokens: state.forward(tokens)[-1:], gamma, request)
        state.drafted = draft.tokens.tolist()
        return draft
