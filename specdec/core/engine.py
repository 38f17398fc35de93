"""The engine: requests and batched speculative steps, on token ids only (no tokenizer here).

Invariant between steps, per request: the target's cache row holds every context token but the
last one, which is fed together with the next draft. So one step is, for every request at once,
a single target forward on its [last token, d_1 .. d_gamma] at positions [L-1 .. L-1+gamma],
giving p for every draft position plus the bonus position; plain decoding is the same step with
an empty draft. The blocks of all requests are flattened into one ragged forward (tokens +
cumulative counts, as vLLM's spec-decode metadata); the linear layers, which dominate, then run
once over every request's tokens.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch

from specdec.core.drafts import (
    NO_DRAFT,
    Draft,
    Drafter,
    ReadsHidden,
    StepOutcome,
    block_depths,
    block_parents,
    propose_many,
    tree_widths,
)
from specdec.core.estimates import CostModel
from specdec.core.metrics import SpecStats
from specdec.core.policy import DraftLengthPolicy, DraftShape
from specdec.core.request import NOT_ISOLATED, PASS_THROUGH, Isolation, Request, VerifyHook
from specdec.core.rules import make_rule
from specdec.core.sampling import SamplingParams, token_logprobs
from specdec.core.verify_batch import Verdict, verify_step
from specdec.grammar import TokenMatcher, compiler_for, mask_logits
from specdec.models.base import Attention, Cache, ForkingCache, LanguageModel, Segment


def decision_costs(costs: CostModel | None, drafter: Drafter | None, policy: object) -> CostModel:
    """The engine's one cost model: ``costs``, or the one its drafter (auto) or its policy object
    (the cost policies) decides with, or a fresh one. Two different models are an error: two
    deciders, one of which would never see the T the engine records."""
    models = {id(model): model for model in (costs, getattr(drafter, "costs", None), getattr(policy, "costs", None))
              if model is not None}
    if len(models) > 1:
        raise ValueError("the drafter, the policy and the engine decide with different cost models: build them "
                         "on one (AutoDrafter(..., costs=...), make_policy(..., costs=...), Engine(..., costs=...))")
    return next(iter(models.values()), None) or CostModel()


@dataclass
class Block:
    """A request's verify block this step: its draft, the grammar's mask over its rows, the
    seconds its drafting took."""

    request: Request
    draft: Draft
    mask: torch.Tensor | None  # [nodes + 1, vocab] bool: what the grammar allows at each row; None: free
    draft_seconds: float


@dataclass
class ScoredBlocks:
    """The target's one forward over every block, flattened in block order."""

    raw_logits: torch.Tensor  # [n, vocab]: as the target gives them (what logprobs report)
    logits: torch.Tensor  # [n, vocab]: with the grammars' masks (what verification reads)
    argmax: torch.Tensor | None  # [n] int64; None when no request is greedy
    hidden: torch.Tensor | None  # [n, features]: the layers the drafter reads
    offsets: list[int]  # [blocks + 1]: where each block's rows start


@dataclass
class Verified:
    """A block after verification: its outcome, its rows' logits, the verdict (for the hook)."""

    block: Block
    outcome: StepOutcome
    block_logits: torch.Tensor  # [nodes + 1, vocab]
    verdict: Verdict


class Engine:
    """Speculative decoding of ``target`` with ``drafter`` over any number of requests.

    The engine holds only what requests share (models, the drafter, a policy template, the one
    cost model); each request has its own cache row, generator, drafter state, policy copy and
    stats, so requests never interfere and every generation starts from the same state.

    ``costs``: the one estimates.CostModel that decides how much to draft (its policies', an auto
    drafter's and a server's controller's choices all read and write it). The engine records every
    step's verify seconds there, at the step's batch and mean block; a drafter that decides with
    a cost model of its own (auto) brings it, and the engine takes it. Its ``clock`` times what
    the engine measures (tests pass a fake one).
    """

    def __init__(
        self,
        target: LanguageModel,
        drafter: Drafter | None = None,
        policy: DraftLengthPolicy | None = None,
        draft_forced: bool = True,
        prefill_chunk: int | None = None,
        max_context: int | None = None,
        verify_hook: VerifyHook | None = None,
        costs: CostModel | None = None,
    ) -> None:
        # Assembled by specdec.assembly.build_engine, which decides the drafter, the policy and the
        # cost model once; here they are only checked to fit together.
        self.drafter = drafter
        self.costs = decision_costs(costs, self.drafter, policy)
        self.verify_hook = verify_hook  # told of each verified step (explain records steps through it)
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token, got {prefill_chunk}")
        self.target = target
        # The longest request, prompt and output (a server's --max-model-len, within its KV-cache
        # budget): longer prompts are refused, generation stops there. At most the target's context.
        self.max_context = min(target.max_context, max_context or target.max_context)
        self.prefill_chunk = prefill_chunk  # prompt pieces (Engine.prefill); None: a prompt in one piece
        # A constrained request's forced tokens are drafted before asking the drafter (off: to measure them)
        self.draft_forced = draft_forced
        # Each request gets its own copy of ``policy``: what a policy learns of the text never leaks
        # between generations; measured seconds (the models' and the machine's) are shared
        # (for_request). None: the caller chooses every step's draft lengths (a server's controller).
        self.policy = policy
        draft_vocab = getattr(self.drafter, "vocab_size", None)
        if draft_vocab is not None and draft_vocab != target.vocab_size:
            raise ValueError(f"the drafter's q ranges over {draft_vocab} tokens, the target's vocabulary over "
                             f"{target.vocab_size}: build it with make_drafter(kind, draft, target=target), which "
                             "fits a padded vocabulary of the same tokenizer and translates another tokenizer")

    def new_policy(self) -> DraftLengthPolicy | None:
        """A request's own policy: a copy of the engine's (None: the caller chooses lengths)."""
        policy = self.policy
        if policy is None:
            return None
        return getattr(policy, "for_request", lambda: copy.deepcopy(policy))()

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the drafter reads (every target forward returns them)."""
        return () if self.drafter is None else self.drafter.hidden_layers

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        ids = [int(token) for token in prompt_ids]
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if len(ids) >= self.max_context:
            held = "" if self.max_context == self.target.max_context else " (--max-model-len, in --kv-cache-memory)"
            raise ValueError(f"prompt has {len(ids)} tokens but the context holds {self.max_context}{held}: "
                             "no room to generate; shorten the prompt")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{self.target.vocab_size - 1})")
        return ids

    def new_request(self, prompt_ids: Sequence[int], sampling: SamplingParams, row: int,
                    matcher: TokenMatcher | None = None) -> Request:
        """A request for cache row ``row``, not yet prefilled. ``matcher``: its constraint's, compiled
        already (a server compiles off its serving loop, GrammarCompiler.matcher); else built here."""
        ids = self.check_prompt(prompt_ids)
        if isinstance(sampling.prediction, str):
            raise ValueError("the engine takes a prediction as token ids: encode its text first (the text layer, "
                             "SpeculativeDecoder and the server, do)")
        device = self.target.device
        budget = min(sampling.max_new_tokens, self.max_context - len(ids))
        tokens = torch.empty(len(ids) + budget, dtype=torch.long, device=device)
        tokens[: len(ids)] = torch.tensor(ids, device=device)
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, (1,)))
        generator = torch.Generator(device=device).manual_seed(seed)
        request = Request(ids, sampling, tokens, len(ids), generator, make_rule(sampling.rule, seed, generator),
                          self.new_policy(), row,
                          stats=SpecStats(prompt_tokens=len(ids), acceptance=sampling.acceptance))
        if self.drafter is not None:
            request.draft_state = self.drafter.start(tokens[: len(ids)])
        if sampling.constraint is not None:
            request.matcher = matcher or compiler_for(self.target).matcher(sampling.constraint)
            request.matcher.draft_forced = self.draft_forced
        return request

    def prefill(self, requests: Sequence[Request], cache: Cache, max_tokens: int | None = None,
                forks: Sequence[tuple[Request, Request]] = (),
                on_prefilled: Callable[[Request, torch.Tensor | None], None] | None = None) -> list[Request]:
        """Feed every prompt but its last token (which the first step feeds). With
        ``prefill_chunk`` None, all prompts in one forward. Else in pieces of that many tokens,
        each at a multiple of it and alone in its forward, so a row's cache holds the same bits
        however the pieces are spread over calls: with ``max_tokens``, a call stops once that
        many are in (at least one piece; request after request), so a long prompt goes in
        between the decode steps of other streams (chunked prefill). ``forks`` (parent, child):
        a child of the same prompt is not fed; once its parent's prefill is done, its row starts
        as a copy of the parent's (one prefill for OpenAI's ``n`` samples; the cache must be a
        ForkingCache). ``on_prefilled(request, features)`` hears of each request fed to its end, with
        the drafter's features of its prompt (a prefix cache keeps both). Returns the requests whose
        prefill is done, forked children included."""
        rows = [*requests, *(child for _, child in forks)]
        for request in rows:
            if request.fed == 0 and cache.lengths[request.row]:  # (an empty row keeps the blocks it holds)
                cache.rollback(request.row, 0)
        if rows:
            cache.reserve(max(request.budget_end for request in rows))
        if self.prefill_chunk is None:
            self.feed_prompts([(r, len(r.prompt_ids) - 1 - r.fed) for r in requests if not r.prefilled], cache)
        else:
            left = max_tokens
            for request in requests:
                while not request.prefilled and (left is None or left > 0):
                    count = min(self.prefill_chunk, len(request.prompt_ids) - 1 - request.fed)
                    self.feed_prompts([(request, count)], cache)
                    left = None if left is None else left - count
        done = [request for request in requests if request.prefilled]
        children = [(parent, child) for parent, child in forks if parent in done]
        for parent, child in children:
            if child.prompt_ids != parent.prompt_ids or child.fed:
                raise ValueError("a forked request continues its parent's prompt, from nothing of its own")
            cast(ForkingCache, cache).fork(parent.row, child.row, parent.fed)
            child.fed = parent.fed
        for request in done:
            features = torch.cat(request.prompt_hidden) if request.prompt_hidden else None
            if features is not None:  # a head reads the prompt's features once, all of them
                for reader in [request, *(child for parent, child in children if parent is request)]:
                    cast(ReadsHidden, self.drafter).prefilled(reader, features)
                request.prompt_hidden = []
            if on_prefilled is not None:
                on_prefilled(request, features)
        return done + [child for _, child in children]

    def feed_prompts(self, pieces: list[tuple[Request, int]], cache: Cache) -> None:
        """One forward of the next ``count`` prompt tokens of each request."""
        if not pieces:
            return
        started = self.costs.clock()
        tokens = torch.cat([request.tokens[request.fed : request.fed + count] for request, count in pieces])
        positions = torch.cat([torch.arange(request.fed, request.fed + count, device=tokens.device)
                               for request, count in pieces])
        attention = Attention(tuple(Segment(request.row, count) for request, count in pieces))
        output = self.target.forward(tokens, positions, cache, attention, want_logits=False,
                                     hidden_layers=self.hidden_layers)
        seconds = self.costs.clock() - started
        for (request, count), start in zip(pieces, attention.offsets, strict=False):
            cache.commit(request.row, count)
            request.fed += count
            request.stats.prefill_seconds += seconds
            if output.hidden is not None:  # [count, features]
                request.prompt_hidden.append(output.hidden[start : start + count])

    def refill(self, request: Request, cache: Cache) -> None:
        """Feed again what a preempted request held in its (emptied) cache row: its prompt in the
        pieces its prefill used (multiples of ``prefill_chunk``, each alone in its forward), then
        the tokens fed by its steps in blocks whose every token is scored as alone (a verify
        block's invariant), so the row holds the bits it held and its text goes on unchanged. Its
        drafter's state is its own and was kept; nothing is told to it."""
        if cache.lengths[request.row]:
            raise ValueError(f"refill needs an emptied row, row {request.row} holds {cache.lengths[request.row]}")
        prompt_end, end = len(request.prompt_ids) - 1, request.length - 1
        piece = self.prefill_chunk or max(1, prompt_end)
        cuts = [*range(0, prompt_end, piece), prompt_end]
        # After the prompt, the first block alone when the row is still empty (as its first step fed it).
        cuts += [*range(prompt_end + (prompt_end == 0), end, piece), end]
        for start, stop in itertools.pairwise(sorted(set(cuts))):
            count = stop - start
            self.target.forward(request.tokens[start:stop], torch.arange(start, stop, device=request.tokens.device),
                                cache, Attention.chain(count, request.row), want_logits=False)
            cache.commit(request.row, count)

    def draft_length(self, request: Request, chosen: int | None = None, batch: int = 1) -> int:
        """The request's draft depth this step, one of ``batch`` requests: its policy's, or
        ``chosen`` (a server's choice, in place of the policy's; a tree then gets its drafter's own
        node budget)."""
        if self.drafter is None or chosen == 0:
            return 0
        if chosen is not None:
            shape = DraftShape(chosen)
        elif request.policy is not None:
            shape = request.policy.next_shape(batch)
        else:
            raise ValueError("this engine gives requests no draft-length policy: Engine.step needs draft_lengths")
        request.shape = shape
        # Every drafted token must still fit in the request's budget.
        return max(0, min(shape.depth, request.budget_end - request.length - 1))

    def step(self, requests: Sequence[Request], cache: Cache, draft_lengths: Sequence[int] | None = None,
             failed: dict[Request, BaseException] | None = None) -> list[StepOutcome]:
        """One speculative step for each request: draft, one target forward for all, verify,
        commit the accepted entries, and append the emitted tokens to each request's context
        (cut at EOS or the end of the budget, which finish the request). ``draft_lengths``: each
        request's draft length this step (a server's choice for the batch; 0: no drafting), in
        place of its policy's; None: the policies choose. ``failed``: given, an error raised for
        one request (its drafter, its grammar matcher, its policy) is stored there under that
        request, which leaves the step, and the outcomes are the other requests', in order (a
        server ends that request only); None: errors propagate."""
        isolation = Isolation(failed)
        proposed, draft_seconds = self.propose_all(requests, draft_lengths, isolation)
        blocks = self.prepare_blocks(requests, proposed, draft_seconds, cache, isolation)
        if not blocks:
            return []
        forwarded_at = self.costs.clock()
        scored = self.forward_blocks(blocks, cache)
        stepped = self.verify_and_commit(blocks, scored, cache, isolation)
        verify_seconds = self.costs.clock() - forwarded_at
        # One measurement of T(batch, block) a step: the rows of the forward, their mean block.
        self.costs.verify.add(len(blocks), sum(block.draft.num_nodes + 1 for block in blocks) / len(blocks),
                              verify_seconds)
        return self.observe(stepped, verify_seconds, isolation)

    def prepare_blocks(self, requests: Sequence[Request], proposed: list[Draft], draft_seconds: list[float],
                       cache: Cache, isolation: Isolation) -> list[Block]:
        """Each request's verify block: its draft cut to what fits in the target's context, what a
        constrained request's grammar allows at each of its rows, and the block's cache slots,
        taken before the forward (a paged cache that runs dry fails this request alone, which a
        server preempts, not the forward of all). The requests that failed leave here."""
        blocks = []
        for request, draft, seconds in zip(requests, proposed, draft_seconds, strict=False):
            began = self.costs.clock()
            draft = draft.truncated(self.max_context - request.length)
            mask = None  # [nodes + 1, vocab] where the request is constrained
            with isolation.of(request):
                if request.matcher is not None:
                    mask = request.matcher.masks_along(draft.tokens.tolist(), draft.parents)
                    request.stats.grammar_seconds += request.matcher.take_seconds()
                cache.ensure(request.row, cache.lengths[request.row] + draft.num_nodes + 1)
            blocks.append(Block(request, draft, mask, seconds + self.costs.clock() - began))
        return [block for block in blocks if isolation.alive(block.request)]

    def forward_blocks(self, blocks: list[Block], cache: Cache) -> ScoredBlocks:
        """One target forward for every request's block (its last token and its drafts, flattened),
        the grammars' masks applied, and one argmax for the whole batch when any request is greedy."""
        requests = [block.request for block in blocks]
        tokens = torch.cat([piece for block in blocks for piece in (
            block.request.tokens[block.request.length - 1 : block.request.length], block.draft.tokens)])  # [n]
        positions = torch.tensor([block.request.length - 1 + depth for block in blocks
                                  for depth in block_depths(block.draft)], device=self.target.device)  # [n]
        attention = Attention(tuple(Segment(block.request.row, block.draft.num_nodes + 1, block_parents(block.draft))
                                    for block in blocks))
        output = self.target.forward(tokens, positions, cache, attention, hidden_layers=self.hidden_layers)
        assert output.logits is not None  # asked for (want_logits defaults to True)
        constrained = [(start, block.mask) for start, block in zip(attention.offsets, blocks, strict=False)
                       if block.mask is not None]
        logits = mask_logits(output.logits, constrained)  # [n, vocab]
        argmax = logits.argmax(-1) if any(r.sampling.greedy for r in requests) else None  # [n]
        return ScoredBlocks(output.logits, logits, argmax, output.hidden, attention.offsets)

    def verify_and_commit(self, blocks: list[Block], scored: ScoredBlocks, cache: Cache,
                          isolation: Isolation) -> list[Verified]:
        """Each block verified against the target's logits; the accepted path's cache entries kept
        (committed, or compacted into place for a tree) with the hidden states, logprobs and the
        grammar's state that follow them."""
        requests, drafts = [block.request for block in blocks], [block.draft for block in blocks]
        verdicts = verify_step(requests, drafts, scored.logits, scored.argmax, scored.offsets,
                               self.verify_hook is not None)
        stepped = []
        for block, start, verdict in zip(blocks, scored.offsets[:-1], verdicts, strict=True):
            request, draft, emitted, path = block.request, block.draft, verdict.emitted, verdict.path
            with isolation.of(request):
                # Keep the entries of the last context token and the accepted drafts.
                if path is None:
                    kept = list(range(emitted.shape[0]))
                    cache.commit(request.row, emitted.shape[0])
                else:
                    kept = [0, *(node + 1 for node in path.tolist())]
                    cache.compact(request.row, kept)
                hidden = None if scored.hidden is None else scored.hidden[[start + k for k in kept]]
                if request.sampling.logprobs is not None:  # the rows that predicted each emitted token
                    request.logprobs += token_logprobs(scored.raw_logits[[start + k for k in kept]], emitted,
                                                       request.sampling.logprobs)
                if request.matcher is not None:
                    request.matcher.consume(self.through_eos(emitted.tolist()))
                    request.stats.grammar_seconds += request.matcher.take_seconds()
                outcome = StepOutcome(emitted, draft.num_nodes, hidden, path, draft.parents, draft.from_cache,
                                      draft.forced, draft.drafter, relaxed=verdict.relaxed)
                stepped.append(Verified(block, outcome, scored.logits[start : start + draft.num_nodes + 1], verdict))
        return stepped

    def observe(self, stepped: list[Verified], verify_seconds: float, isolation: Isolation) -> list[StepOutcome]:
        """Tell the verify hook, the drafter, the policy and the stats of each request's step, and
        finish the requests that reached EOS or their budget."""
        outcomes = []
        for verified in stepped:
            request, outcome = verified.block.request, replace(verified.outcome, verify_seconds=verify_seconds)
            with isolation.of(request):
                if self.verify_hook is not None:
                    self.verify_hook(request, verified.block.draft, verified.block_logits, verified.verdict,
                                     verified.block.draft_seconds, verify_seconds)
                self.advance(request, outcome, verified.block.draft_seconds, verify_seconds)
                self.check_finished(request, outcome)
                outcomes.append(outcome)
        return outcomes

    def propose_all(self, requests: Sequence[Request], draft_lengths: Sequence[int] | None,
                    isolation: Isolation = PASS_THROUGH) -> tuple[list[Draft], list[float]]:
        """This step's drafts and the seconds each took: the tokens a request's grammar forces,
        else the drafter's (cut where the grammar refuses them), else nothing. The drafter drafts
        for all the requests that ask in one call (a head: one forward per depth for the batch),
        its time shared evenly between them. A request that fails under ``isolation`` keeps an
        empty draft (Engine.step then leaves it out)."""
        drafts: list[Draft] = [Draft.empty(request.tokens.device) for request in requests]
        seconds = [0.0] * len(requests)
        asking, gammas = [], []
        for index, request in enumerate(requests):
            began = self.costs.clock()
            forced, chosen = None, None if draft_lengths is None else draft_lengths[index]
            with isolation.of(request):
                if request.matcher is not None and self.draft_forced and chosen != 0:
                    forced = forced_draft(request.matcher, request.budget_end - request.length - 1,
                                          request.tokens.device)
                if forced is not None:
                    drafts[index] = forced
                elif self.drafter is not None and (gamma := self.draft_length(request, chosen, len(requests))) > 0:
                    asking.append(index)
                    gammas.append(gamma)
                elif getattr(self.drafter, "names_drafts", False):  # not asked: counted as no draft
                    drafts[index] = replace(drafts[index], drafter=NO_DRAFT)
            seconds[index] += self.costs.clock() - began
        if not asking:
            return drafts, seconds
        began = self.costs.clock()
        batch = self.propose_batch([requests[index] for index in asking], gammas, isolation)
        share = (self.costs.clock() - began) / len(asking)
        for index, draft in zip(asking, batch, strict=True):
            began = self.costs.clock()
            request = requests[index]
            with isolation.of(request):
                if draft.translation is not None:
                    request.stats.observe_translation(draft.translation.proposed, draft.translation.kept)
                drafts[index] = draft if request.matcher is None else fit_draft(request.matcher, draft)
            seconds[index] += share + self.costs.clock() - began
        return drafts, seconds

    def propose_batch(self, requests: list[Request], gammas: list[int], isolation: Isolation) -> list[Draft]:
        """The drafter's drafts for ``requests``, in one call; if that call fails under isolation,
        request by request, so that only the requests the drafter fails on fail (with an empty
        draft): a batched drafter cannot say whose row broke it."""
        assert self.drafter is not None  # only then does a request ask
        if isolation.failed is None:
            return propose_many(self.drafter, requests, gammas)
        try:
            return propose_many(self.drafter, requests, gammas)
        except NOT_ISOLATED:
            raise
        except BaseException:  # noqa: BLE001 - whose it is is found below, one request at a time
            drafts = []
            for request, gamma in zip(requests, gammas, strict=True):
                drafts.append(Draft.empty(request.tokens.device))
                with isolation.of(request):
                    drafts[-1] = propose_many(self.drafter, [request], [gamma])[0]
            return drafts

    def through_eos(self, tokens: list[int]) -> list[int]:
        """tokens up to and including the first end token (what stays in the context)."""
        ends = [index for index, token in enumerate(tokens) if token in self.target.eos_token_ids]
        return tokens[: ends[0] + 1] if ends else tokens

    def advance(self, request: Request, outcome: StepOutcome, draft_seconds: float, verify_seconds: float) -> None:
        """Append the emitted tokens and tell the drafter, the policy and the stats."""
        count = outcome.emitted.shape[0]
        request.tokens[request.length : request.length + count] = outcome.emitted
        request.length += count
        widths = tree_widths(outcome.parents)
        if self.drafter is not None:
            self.drafter.observe(request, outcome)
            # A step of the grammar's tokens says nothing of how well the drafter guesses (tokens forced
            # inside a draft model's chain are its chain's, and count as its drafts)
            if not outcome.forced and request.policy is not None:
                request.policy.update(request.shape, outcome.num_drafted, outcome.num_accepted, draft_seconds, widths)
        if outcome.forced:
            request.stats.observe_forced(outcome.num_accepted)
        else:
            request.stats.observe(outcome.num_drafted, outcome.num_accepted, widths, outcome.drafter)
        if outcome.from_cache is not None:
            request.stats.observe_cache(sum(outcome.from_cache), outcome.accepted_from_cache)
        request.stats.relaxed_accepted += len(outcome.relaxed)
        request.stats.draft_seconds += draft_seconds
        request.stats.verify_seconds += verify_seconds

    def check_finished(self, request: Request, outcome: StepOutcome) -> None:
        """Finish the request at the step's first EOS or at the end of its budget, dropping the
        step's tokens after that point from its context."""
        emitted = outcome.emitted.tolist()
        first = request.length - len(emitted)
        eos = self.target.eos_token_ids
        for index, token in enumerate(emitted):
            length = first + index + 1  # context length with this token
            if token in eos:
                request.finish_reason = "eos"
            elif length >= request.budget_end:
                generated = length - len(request.prompt_ids)
                request.finish_reason = "max_new_tokens" if generated >= request.sampling.max_new_tokens else "context"
            if request.finish_reason is not None:
                request.truncate(length)
                return


def fit_draft(matcher: TokenMatcher, draft: Draft) -> Draft:
    """A chain cut at its first token the grammar refuses: a point-mass draft drops it; a draft
    drawn from q keeps it (the masked p rejects it for certain, and cutting it would change which
    distribution the step's last token is drawn from). A tree is kept whole: verification never
    goes below a refused node."""
    if draft.parents is not None or not draft.num_nodes:
        return draft
    valid = matcher.valid_prefix(draft.tokens.tolist())
    return draft.truncated(valid if draft.probs is None else valid + 1)


def forced_draft(matcher: TokenMatcher, room: int, device: torch.device) -> Draft | None:
    """The tokens the grammar forces next, as a point-mass draft that the masked p accepts for
    certain (None where nothing is forced)."""
    forced = matcher.forced()[:room]
    if not forced:
        return None
    return Draft(torch.tensor(forced, dtype=torch.long, device=device), forced=True)
