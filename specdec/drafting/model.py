"""A smaller language model as the drafter."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome
from specdec.core.sampling import SamplingParams, logits_to_probs
from specdec.drafting.lockstep import DraftSteps, relay, run_in_lockstep
from specdec.models.base import Attention, LanguageModel, Segment
from specdec.models.cache import KVCache, RowPool
from specdec.models.primitives import widen_logits


class DraftModelState:
    """One request's row of the draft model's cache, and the context tokens not yet fed to it.

    Invariant: the row's committed tokens followed by ``pending`` are the request's context
    (while drafting, the drafted tokens fed so far follow the context in the row). observe()
    keeps the entries of accepted drafts and queues the rest of what was emitted: no diffing.
    The row is the drafter's to lend (one cache for all requests, so one forward drafts for all:
    DraftModelDrafter.rows), or a cache of the request's own where the model's cache cannot grow rows.
    """

    def __init__(self, model: LanguageModel, prompt_ids: torch.Tensor,  # prompt_ids [n]
                 rows: RowPool | None = None) -> None:
        self.model = model
        if rows is None:
            self.cache, self.row = model.new_cache(), 0
        else:
            self.cache, self.row = rows.cache, rows.lend(self)  # the row is free again once the request is gone
        self.pending = prompt_ids  # [m] int64
        self.drafted: list[int] = []  # the last draft's tokens; the row holds a prefix of them

    @property
    def fed(self) -> int:
        """Tokens in the row (the context's, then drafted ones)."""
        return self.cache.lengths[self.row]

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

    def take_pending(self) -> torch.Tensor:  # [m] int64
        """The context tokens the row lacks, to be fed now (at least the last one: its logits
        give q for the first draft token)."""
        pending, self.pending = self.pending, self.pending[:0]
        return pending

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [k] -> logits [k, vocab]
        return self.model.extend(tokens, self.cache, self.row, batch_invariant=False)  # a draft needs no exactness

    def drop(self, count: int) -> None:
        """Forget the row's last ``count`` entries."""
        self.cache.rollback(self.row, self.fed - count)

    def observe(self, context_length: int, emitted: torch.Tensor) -> None:
        """The context now has context_length tokens, the last len(emitted) of them new."""
        before = context_length - emitted.shape[0]  # the context's length when the step began
        fed = self.fed
        if fed < before:  # nothing was drafted: the cache did not move
            self.pending = torch.cat([self.pending, emitted])
            return
        # Cache entries past `before` hold this drafter's own tokens (self.drafted, in order);
        # those the target accepted stay. (Another drafter's branch may have won: compare.)
        in_cache = self.drafted[: fed - before]
        agree = common_prefix(in_cache, emitted[:-1].tolist())
        self.cache.rollback(self.row, before + agree)
        self.pending = emitted[agree:]

    def rewind(self, context: torch.Tensor, kept: int) -> None:  # context [n] int64
        """The context is now ``context``, of which only the first ``kept`` tokens are known to
        match what was fed (a translating drafter re-tokenizes the tail of its context): the
        cache keeps at most those, and the rest of the context is queued (at least the last
        token, whose logits give q for the next draft)."""
        fed = max(0, min(self.fed, kept, context.shape[0] - 1))
        self.cache.rollback(self.row, fed)
        self.pending = context[fed:]


@dataclass(frozen=True)
class RowBlock:
    """A request's tokens for a draft forward: a chain after its row's entries (committed), or a
    tree's new nodes (``parents`` of all nodes so far, ``written`` of them from earlier forwards;
    not committed: a tree stays past the context)."""

    state: DraftModelState
    tokens: torch.Tensor  # [k] int64
    positions: torch.Tensor  # [k] int64
    parents: tuple[int, ...] | None = None
    written: int = 0

    @staticmethod
    def chain(state: DraftModelState, tokens: torch.Tensor) -> RowBlock:  # tokens [k]
        return RowBlock(state, tokens, torch.arange(state.fed, state.fed + tokens.shape[0], device=tokens.device))


def score_blocks(blocks: Sequence[RowBlock]) -> list[torch.Tensor]:  # logits [k, vocab] per block
    """Every block scored by its state's draft model: one forward for the blocks that share a model
    and a cache (a drafter's lent rows), so a batch's draft step costs one forward, not one a request."""
    logits: list[torch.Tensor] = [torch.empty(0)] * len(blocks)
    groups: dict[tuple[int, int], list[int]] = {}
    for index, block in enumerate(blocks):
        groups.setdefault((id(block.state.model), id(block.state.cache)), []).append(index)
    for indices in groups.values():
        state = blocks[indices[0]].state
        attention = Attention(tuple(Segment(blocks[i].state.row, blocks[i].tokens.shape[0], blocks[i].parents,
                                            blocks[i].written) for i in indices), batch_invariant=False)
        out = state.model.forward(torch.cat([blocks[i].tokens for i in indices]),
                                  torch.cat([blocks[i].positions for i in indices]), state.cache, attention).logits
        assert out is not None  # want_logits defaults to True
        for i, start, end in zip(indices, attention.offsets, attention.offsets[1:], strict=False):
            if blocks[i].parents is None:
                blocks[i].state.cache.commit(blocks[i].state.row, end - start)
            logits[i] = out[start:end]
    return logits


def common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens the two sequences share."""
    count = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        count += 1
    return count


@dataclass(frozen=True)
class LogitColumns:
    """The target tokens a draft's logits are over, where that is a draft vocabulary (a head's):
    a greedy pick needs only those columns (an argmax over a head's 8,192 logits, not over the
    1.5B target's 151,936 with -inf in the rest: that mapping and pick took about three quarters
    as long as the head's forward, docs/benchmarks/stack-epyc-vnni); q for sampling and grammar
    masks are over the whole vocabulary (``widen``)."""

    token_ids: torch.Tensor  # [columns] int64, ascending: ties pick the same token as in the wide logits
    vocab_size: int

    def widen(self, logits: torch.Tensor) -> torch.Tensor:  # [n, columns] -> [n, vocab]
        """Logits over the target's vocabulary: -inf outside the columns (q = 0 there)."""
        return widen_logits(logits, self.token_ids, self.vocab_size)


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
    assert source is not None, "a sampled draft has its q"
    return float(source[0, token])


def chain_steps(
    logits: torch.Tensor,  # [1, vocab] (or [1, columns]): the draft's logits for the first token
    gamma: int,
    request: DraftRequest,
    columns: LogitColumns | None = None,  # what the logits are over, where not the whole vocabulary
) -> DraftSteps[torch.Tensor]:  # yields token blocks [k], is sent the next logits (as the first's) after each
    """Up to gamma tokens, one at a time, each drawn from q (or the argmax when greedy); the
    request's policy may stop it early (stop_early, on the chain's probability under the draft).
    A constrained request's q is masked to what its grammar allows along the chain (the matcher
    walks the chain and is rolled back), so the draft never proposes a token the target's masked
    p must reject; where the grammar forces tokens, they join the chain without a draw (q a point
    mass, as the masked p is there) and the draft reads them in one forward. A generator
    (drafting/lockstep.py), so that a batch of requests can draft in lockstep."""
    sampling, stop_early, matcher = request.sampling, request.stop_early, request.matcher
    # A greedy pick without a grammar reads the columns alone; q and masks need the whole vocabulary.
    narrow_ids = columns.token_ids if columns is not None and sampling.greedy and matcher is None else None
    first_position = request.context.shape[0]
    tokens: list[torch.Tensor] = []  # [1] each
    probs: list[torch.Tensor] = []  # q rows: [1, vocab] each, or [k, vocab] for forced blocks
    chain_probability = 1.0
    try:
        while True:
            if columns is not None and narrow_ids is None:
                logits = columns.widen(logits)
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
            column = token  # the token's column in the logits
            if narrow_ids is not None:
                token = narrow_ids[column]
            tokens.append(token)
            if step_probs is not None:
                probs.append(step_probs)
            if len(tokens) == gamma or (matcher is not None and not matcher.look_ahead(int(token))):
                break
            if stop_early is not None:
                chain_probability *= token_confidence(logits, step_probs, column, sampling)
                if stop_early(len(tokens), chain_probability):
                    break
            logits = yield token
    finally:
        if matcher is not None:
            matcher.end_look_ahead()
    return Draft(torch.cat(tokens), torch.cat(probs) if probs else None)


class DraftModelDrafter(BaseDrafter):
    """What every drafter built on a draft model shares: one row of one draft cache per request
    (DraftModelState), observe() keeping the entries of the accepted drafts, and propose_many
    drafting every request of a step in lockstep, one draft forward per round for all."""

    def __init__(self, model: LanguageModel) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        cache = model.new_cache()
        # Backends whose cache cannot grow rows (transformers, llama.cpp) keep a cache per request.
        self.rows = RowPool(cache) if isinstance(cache, KVCache) else None

    def start(self, prompt_ids: torch.Tensor) -> DraftModelState:
        return DraftModelState(self.model, prompt_ids, self.rows)

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        request.draft_state.observe(request.context.shape[0], outcome.emitted)

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        return self.propose_many([request], [gamma])[0]

    def propose_many(self, requests: Sequence[DraftRequest], gammas: Sequence[int]) -> list[Draft]:
        drafts = [Draft.empty(request.context.device) for request in requests]
        drafting = [(index, routine) for index, (request, gamma) in enumerate(zip(requests, gammas, strict=True))
                    if (routine := self.routine(request, gamma)) is not None]
        batch = run_in_lockstep([routine for _, routine in drafting],
                                lambda asking, blocks: score_blocks(blocks))
        for (index, _), draft in zip(drafting, batch, strict=True):
            requests[index].draft_state.drafted = draft.tokens.tolist()
            drafts[index] = draft
        return drafts

    def routine(self, request: DraftRequest, gamma: int) -> DraftSteps[RowBlock] | None:
        """The request's drafting as a generator of draft forwards (RowBlocks, each sent its
        logits); None when it drafts nothing."""
        raise NotImplementedError


class ModelDrafter(DraftModelDrafter):
    """Drafts a chain autoregressively with its own model, a row of the draft cache per request."""

    def describe(self) -> str:
        return f"draft model {self.model.name}"

    def routine(self, request: DraftRequest, gamma: int) -> DraftSteps[RowBlock] | None:
        state: DraftModelState = request.draft_state
        gamma = state.start_draft(request.context.shape[0], gamma)
        return None if gamma == 0 else model_chain_steps(state, gamma, request)


def model_chain_steps(state: DraftModelState, gamma: int, request: DraftRequest) -> DraftSteps[RowBlock]:
    """chain_steps with its blocks fed to the state's row: first the context the row lacks, then
    each drafted block; each is answered with its logits, of which the chain reads the last."""
    logits = yield RowBlock.chain(state, state.take_pending())
    return (yield from relay(chain_steps(logits[-1:], gamma, request), lambda block: RowBlock.chain(state, block),
                             lambda logits: logits[-1:]))
