"""Staged drafting (Spector & Re 2023): the draft model drafts, itself sped up by an n-gram stage.

The n-gram stage guesses ahead; the draft model scores the guess in one forward and verifies
it with the same rules the target uses (greedy, or rejection sampling against its own q), then
adds one token of its own. The tokens handed on are therefore distributed exactly as the draft
model's own samples, and q stays the draft model's distribution, so the target's verification
is unchanged. The gain: several draft tokens per draft forward when the text repeats itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome
from specdec.core.sampling import logits_to_probs
from specdec.core.verify import greedy_verify
from specdec.drafting.model import DraftModelState, token_confidence
from specdec.drafting.ngram import NGramDrafter, NGramIndex
from specdec.models.base import LanguageModel


@dataclass
class Trunk:
    """A staged chain: its tokens, the draft logits each came from and, when sampling, their q."""

    tokens: torch.Tensor  # [k] int64
    logits: torch.Tensor | None  # [k, vocab]
    probs: torch.Tensor | None  # [k, vocab], None when greedy


@dataclass
class StagedState:
    model: DraftModelState
    index: NGramIndex
    guessed: int = 0  # n-gram guesses this request's stage tried, and how many the draft model kept
    guesses_kept: int = 0


class StagedDrafter(BaseDrafter):

    def __init__(self, model: LanguageModel, max_n: int = 4, min_n: int = 1) -> None:
        self.model = model
        self.ngram = NGramDrafter(max_n, min_n)
        self.vocab_size = model.vocab_size

    def describe(self) -> str:
        return (
            f"staged: draft model {self.model.name} with an n-gram stage ({self.ngram.min_n}-{self.ngram.max_n}-grams)"
        )

    def start(self, prompt_ids: torch.Tensor) -> StagedState:
        return StagedState(DraftModelState(self.model, prompt_ids), self.ngram.start(prompt_ids))

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        state: StagedState = request.draft_state
        state.model.observe(request.context.shape[0], outcome.emitted)
        state.index.extend(outcome.emitted.tolist())

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        trunk = self.draft_trunk(request, gamma)
        return Draft(trunk.tokens, trunk.probs)

    def draft_trunk(self, request: DraftRequest, gamma: int) -> Trunk:
        state: StagedState = request.draft_state
        context, sampling, stop_early = request.context, request.sampling, request.stop_early
        gamma = state.model.start_draft(context.shape[0], gamma)
        if gamma == 0:
            return Trunk(Draft.empty(context.device).tokens, None, None)
        pending = state.model.take_pending()  # [m >= 1], not yet in the draft cache
        drafted: list[int] = []
        logit_rows: list[torch.Tensor] = []  # the draft's logits each token came from, [1, vocab] each
        probs: list[torch.Tensor] = []  # q rows, [1, vocab] each
        chain_probability = 1.0
        while len(drafted) < gamma:
            # Leave room for the draft model's own token after the guess.
            guess_list = state.index.lookup(state.index.tokens + drafted, gamma - len(drafted) - 1)
            guess = torch.tensor(guess_list, dtype=torch.long, device=context.device)  # [g]
            logits = state.model.forward(torch.cat([pending, guess]))[-(guess.shape[0] + 1) :]  # [g + 1, vocab]
            if sampling.greedy:  # greedy needs no q
                step_probs = None
                emitted = greedy_verify(guess, logits)
            else:
                step_probs = logits_to_probs(logits, sampling)  # [g + 1, vocab], q
                # The draft model's own sample, judged as the target judges drafts: the stage hands
                # on exact draws of q (under the coupled rule, the very draws q / E gives).
                emitted = request.rule.verify_chain(guess, None, step_probs, context.shape[0] + len(drafted))
            n_accepted = emitted.shape[0] - 1
            state.guessed += guess.shape[0]
            state.guesses_kept += n_accepted
            # Keep cache entries up to the last accepted guess; the new token is fed next round.
            state.model.drop(guess.shape[0] - n_accepted)
            pending = emitted[-1:]
            stop = False
            for position, token in enumerate(emitted.tolist()):
                drafted.append(token)
                logit_rows.append(logits[position : position + 1])
                row = None if step_probs is None else step_probs[position : position + 1]
                if row is not None:
                    probs.append(row)
                if stop_early is not None and len(drafted) < gamma:
                    chain_probability *= token_confidence(
                        logits[position : position + 1], row, emitted[position : position + 1], sampling
                    )
                    stop = stop_early(len(drafted), chain_probability)
                    if stop:
                        break
            if stop:
                break
        drafted = drafted[:gamma]
        state.model.drafted = drafted  # the cache holds a prefix of these past the context
        return Trunk(
            torch.tensor(drafted, dtype=torch.long, device=context.device),
            torch.cat(logit_rows)[:gamma],
            torch.cat(probs)[:gamma] if probs else None,
        )


class StagedTreeDrafter(StagedDrafter):
    """Staged drafting feeding a tree: the staged chain is the trunk, and at each trunk depth the
    draft's other likely tokens at that position become side leaves. The draft model already
    computed those distributions for the trunk, so the tree costs no extra draft forward; only
    the target's verify block grows. Width per depth (trunk node + leaves) is the policy's node
    budget over its depth (e.g. the tree-cost policy's choice), else ``budget`` over gamma.

    Lossless when sampling: the trunk token at a depth was drawn from q there (the staged stage
    hands on exact samples of the draft model), and its leaves are then drawn from the same q
    without replacement, so the siblings are the sequential draws without replacement that
    tree_rejection_sample assumes. How many leaves a depth gets depends on q alone (its support),
    never on the tokens drawn. When greedy, the leaves are the next-best tokens."""

    def __init__(self, model: LanguageModel, max_n: int = 4, min_n: int = 1, budget: int = 16) -> None:
        super().__init__(model, max_n, min_n)
        self.budget = budget

    def describe(self) -> str:
        return f"staged tree: {super().describe().removeprefix('staged: ')}, side leaves up to {self.budget} nodes"

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        trunk = self.draft_trunk(request, gamma)
        depth = trunk.tokens.shape[0]
        if depth == 0:
            return Draft(trunk.tokens)
        trunk_logits, trunk_probs = trunk.logits, trunk.probs  # [depth, vocab] each; probs None when greedy
        assert trunk_logits is not None, "only an empty trunk has no logits"
        width = max(1, (request.node_budget or self.budget) // depth)
        greedy = request.sampling.greedy
        first_position = request.context.shape[0]  # the output position of the first trunk token
        tokens: list[int] = []
        parents: list[int] = []
        q_rows: list[torch.Tensor] = []  # q_rows[i]: the q trunk token i and its leaves were drawn from
        trunk_nodes: list[int] = []
        parent = -1
        for position, trunk_token in enumerate(trunk.tokens.tolist()):
            tokens.append(trunk_token)
            parents.append(parent)
            trunk_nodes.append(len(tokens) - 1)
            if greedy:
                ranked = trunk_logits[position].topk(min(width + 1, trunk_logits.shape[-1])).indices.tolist()
                leaves = [token for token in ranked if token != trunk_token][: width - 1]
            else:
                assert trunk_probs is not None, "a sampled trunk carries its q"
                q = trunk_probs[position]  # [vocab]
                q_rows.append(q)
                rest = q.clone()
                rest[trunk_token] = 0.0
                count = min(width - 1, int((rest > 0).sum()))
                leaves = request.rule.draw_distinct(rest, first_position + position, count).tolist() if count else []
            for leaf in leaves:
                tokens.append(leaf)
                parents.append(parent)
            parent = trunk_nodes[-1]
        block = torch.tensor(tokens, dtype=torch.long, device=trunk.tokens.device)
        if greedy:
            return Draft(block, None, tuple(parents))
        # Row 0: q at the root; row i + 1: q at node i (zeros at the leaves: they have no children).
        assert trunk_probs is not None, "a sampled trunk carries its q"
        probs = torch.zeros(len(tokens) + 1, trunk_probs.shape[-1], dtype=trunk_probs.dtype, device=block.device)
        for position, q in enumerate(q_rows):
            probs[0 if position == 0 else trunk_nodes[position - 1] + 1] = q
        return Draft(block, probs, tuple(parents))
