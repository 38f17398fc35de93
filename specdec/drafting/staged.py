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

from specdec.drafting.base import Draft, DraftRequest, StepOutcome
from specdec.drafting.model import DraftModelState, token_confidence
from specdec.drafting.ngram import NGramDrafter, NGramIndex
from specdec.models.base import LanguageModel
from specdec.sampling import logits_to_probs
from specdec.verify import greedy_verify, rejection_sample


@dataclass
class StagedState:
    model: DraftModelState
    index: NGramIndex


class StagedDrafter:
    wants_hidden = False

    def __init__(self, model: LanguageModel, max_n: int = 4, min_n: int = 1) -> None:
        self.model = model
        self.ngram = NGramDrafter(max_n, min_n)
        self.vocab_size = model.vocab_size
        self.stage_guessed = self.stage_accepted = 0  # how the n-gram stage fares against the draft model

    def start(self, prompt_ids: torch.Tensor) -> StagedState:
        return StagedState(DraftModelState(self.model, prompt_ids), self.ngram.start(prompt_ids))

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        state: StagedState = request.draft_state
        state.model.observe(request.context.shape[0], outcome.emitted)
        state.index.extend(outcome.emitted.tolist())

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        state: StagedState = request.draft_state
        context, sampling, stop_early = request.context, request.sampling, request.stop_early
        gamma = state.model.start_draft(context.shape[0], gamma)
        if gamma == 0:
            return Draft.empty(context.device)
        pending = state.model.pending  # [m >= 1], not yet in the draft cache
        state.model.pending = pending[:0]
        drafted: list[int] = []
        probs: list[torch.Tensor] = []  # q rows, [k, vocab] each
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
                emitted = rejection_sample(guess, None, step_probs, request.generator, validate=False)
            n_accepted = emitted.shape[0] - 1
            self.stage_guessed += guess.shape[0]
            self.stage_accepted += n_accepted
            # Keep cache entries up to the last accepted guess; the new token is fed next round.
            cache = state.model.cache
            cache.rollback(0, cache.lengths[0] - (guess.shape[0] - n_accepted))
            pending = emitted[-1:]
            stop = False
            for position, token in enumerate(emitted.tolist()):
                drafted.append(token)
                row = None if step_probs is None else step_probs[position : position + 1]
                if row is not None:
                    probs.append(row)
                if stop_early is not None and len(drafted) < gamma:
                    chain_probability *= token_confidence(logits[position : position + 1], row,
                                                          emitted[position : position + 1], sampling)
                    stop = stop_early(len(drafted), chain_probability)
                    if stop:
                        break
            if stop:
                break
        state.model.drafted = drafted  # the cache holds a prefix of these past the context
        tokens = torch.tensor(drafted[:gamma], dtype=torch.long, device=context.device)
        return Draft(tokens, torch.cat(probs)[:gamma] if probs else None)
