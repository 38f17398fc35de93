"""A drafter for benchmarks: the target's own greedy continuation, corrupted at a set rate, so
that acceptance is whatever alpha the benchmark asks for."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.core.drafts import Draft, DraftRequest, StepOutcome
from specdec.drafting.model import DraftModelState
from specdec.models.base import LanguageModel


@dataclass
class OracleState:
    model: DraftModelState
    expected: torch.Tensor  # [n]: prompt + the target's greedy output


class CorruptedOracleDrafter:
    """Proposes the target's own greedy continuation with each token replaced, with probability
    1 - alpha, by a uniformly random different token; runs the draft model on what it proposes
    so that drafting costs what a real draft model costs. Deterministic proposals (no q), so
    verification treats them as point masses. For benchmarks only: it needs the answer."""

    vocab_size: int | None = None  # None: proposes token ids, no q over a vocabulary
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, draft_model: LanguageModel, alpha: float, vocab_size: int, seed: int = 0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
        self.draft_model = draft_model
        self.alpha = alpha
        self.target_vocab = vocab_size
        self.random = random.Random(seed)
        self.expected = torch.empty(0, dtype=torch.long)  # [n]: prompt + the target's greedy output
        self.off_reference = 0  # proposals made where the context had left the expected sequence

    def expect(self, sequence: Sequence[int]) -> None:
        """The sequence target-only greedy decoding produces (prompt + output)."""
        self.expected = torch.tensor(list(sequence), dtype=torch.long)

    def start(self, prompt_ids: torch.Tensor) -> OracleState:
        return OracleState(DraftModelState(self.draft_model, prompt_ids), self.expected)

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        """Acceptance is set by alpha; only the draft model's cache follows the context."""
        request.draft_state.model.observe(request.context.shape[0], outcome.emitted)

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        state: OracleState = request.draft_state
        context = request.context
        n = context.shape[0]
        gamma = state.model.start_draft(n, gamma)
        if gamma == 0:
            return Draft.empty(context.device)
        state.model.forward(state.model.take_pending())
        # The target's continuation is known only while the context follows the expected sequence.
        expected = state.expected
        on_reference = n <= expected.shape[0] and torch.equal(context.cpu(), expected[:n])
        tokens = []
        for position in range(n, n + gamma):
            if on_reference and position < expected.shape[0]:
                token = int(expected[position])
            else:
                self.off_reference += 1
                token = self.random.randrange(self.target_vocab)
            if self.random.random() >= self.alpha:
                token = (token + self.random.randrange(1, self.target_vocab)) % self.target_vocab
            tokens.append(token)
            if len(tokens) < gamma:  # the draft model reads each proposal, as a real drafter would
                state.model.forward(torch.tensor([token], device=context.device))
        state.model.drafted = tokens
        return Draft(torch.tensor(tokens, dtype=torch.long, device=context.device))
