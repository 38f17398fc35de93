"""Drafting with a model of another tokenizer: text is the common currency.

The draft model keeps its own state over its own token ids: the request's context re-tokenized
with the draft's tokenizer. Each step:

- propose: the inner drafter drafts greedily in draft ids; they are decoded to text after a
  look-behind of the draft context (byte-level tokens and word-initial spaces only decode right
  in context), and that text is encoded with the target's tokenizer after the last few target
  tokens of the context (a look-behind again), so that the boundary is tokenized as the target
  tokenizes it. The target ids past the look-behind are the proposal, cut to gamma.
- observe: the text of the emitted target tokens is appended to the draft context, the last few
  draft tokens re-tokenized together with it (the tokenization the draft was trained on); the
  draft's cache keeps the longest prefix it shares with the new draft context. A character
  whose bytes are split over target tokens waits until it is complete (no drafting meanwhile).

Lossless, whatever the translation does. The proposal is handed on as deterministic guesses
(Draft.probs None, point masses). Greedy verification accepts a guess only where it equals the
target's argmax. When sampling, verification accepts a guess x with probability p(x) and
otherwise samples from p without x, renormalized (the residual max(0, p - 1_x)): the emitted
token has law p(x) 1{y = x} + (1 - p(x)) p(y) 1{y != x} / (1 - p(x)) = p(y) for every y, whatever
x is, as long as x was chosen without looking at the uniform draws that judge it (the draft reads
only its own context). The draft drafts greedily because a point mass on x is accepted with
probability p(x): the draft's most likely token is its best guess of where p is large.
The draft's q is not used: one draft token may become several target tokens or part of one, so
it is no distribution over target tokens. (Token-level intersection, Timor et al. 2025, keeps q
on the strings both vocabularies share; it needs one draft token to be one target token, which
re-tokenized text breaks, and it restricts the draft to the shared strings.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.drafting.base import Draft, DraftRequest, StepOutcome, Translation
from specdec.drafting.merge import SubRequest
from specdec.drafting.model import DraftModelState, ModelDrafter
from specdec.sampling import SamplingParams

INCOMPLETE = "\ufffd"  # what decoding shows for the bytes of a character not yet complete
GREEDY = SamplingParams()  # the draft's guesses: its argmax (see the module docstring)
MAX_EXTRA_LOOK_BEHIND = 4  # tokens added to a look-behind that starts inside a character


def decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def look_behind_tail(tokenizer: Any, context: list[int], look_behind: int) -> tuple[list[int], str]:
    """The context's last look_behind tokens and their text, the tail widened by up to a few
    tokens when it would start inside a character (its text would begin with INCOMPLETE)."""
    count = min(look_behind, len(context))
    while True:
        tail = context[len(context) - count :] if count else []
        text = decode(tokenizer, tail)
        if not text.startswith(INCOMPLETE) or count >= min(len(context), look_behind + MAX_EXTRA_LOOK_BEHIND):
            return tail, text
        count += 1


def appended_text(tokenizer: Any, context: list[int], new: list[int], look_behind: int) -> str:
    """The text ``new`` adds after ``context``, decoded together with the context's last
    look_behind tokens. A character whose bytes are split across the boundary counts as new."""
    tail, before = look_behind_tail(tokenizer, context, look_behind)
    before = before.rstrip(INCOMPLETE)
    after = decode(tokenizer, tail + new)
    return after[len(before):] if after.startswith(before) else decode(tokenizer, new)


def continuation_ids(tokenizer: Any, context: list[int], text: str, look_behind: int) -> list[int]:
    """Token ids that continue ``context`` with ``text``: the text encoded after the context's
    last look_behind tokens, so the boundary merges as the tokenizer would merge it. When that
    re-encoding changes the context's own tokens (the text would merge into the last one), the
    text is encoded alone: a continuation the target may still produce."""
    tail, tail_text = look_behind_tail(tokenizer, context, look_behind)
    ids = encode(tokenizer, tail_text + text)
    if ids[: len(tail)] == tail:
        return ids[len(tail):]
    return encode(tokenizer, text)


def common_prefix(first: list[int], second: list[int]) -> int:
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count


@dataclass
class TranslationState:
    """One request: the inner drafter's state and the context in the draft's tokens."""

    inner: DraftModelState
    draft_ids: list[int]  # the text of the target context's first `synced` tokens, in draft ids
    synced: int  # target context tokens whose text is in draft_ids
    drafted: list[int] = field(default_factory=list)  # this step's draft, in draft ids


@dataclass
class DraftTokenRequest(SubRequest):
    """The inner drafter's view of a request: the context in draft ids, its own state, greedy."""

    draft_context: torch.Tensor | None = None  # [n] int64, draft ids

    @property
    def context(self) -> torch.Tensor:
        return self.draft_context

    @property
    def sampling(self) -> SamplingParams:
        return GREEDY


class TranslatingDrafter:
    """A draft model of another tokenizer as a drafter in the target's token ids (see the module
    docstring). ``inner`` drafts chains in the draft's ids; look_behind is the number of context
    tokens decoded and re-encoded with each piece of new text."""

    wants_hidden = False
    vocab_size = None  # deterministic guesses in the target's ids: no q

    def __init__(self, inner: ModelDrafter, draft_tokenizer: Any, target_tokenizer: Any, look_behind: int = 4) -> None:
        if type(inner) is not ModelDrafter:
            raise ValueError("a draft with another tokenizer drafts chains with its model (--drafter model); "
                             "staged and tree drafting need the target's tokenizer (or use --drafter ngram, "
                             "which needs no draft model)")
        if draft_tokenizer is None or target_tokenizer is None:
            raise ValueError("translating between vocabularies needs both models' tokenizers")
        if look_behind < 1:
            raise ValueError(f"look_behind must be >= 1, got {look_behind}")
        self.inner, self.look_behind = inner, look_behind
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.device = inner.model.device

    def start(self, prompt_ids: torch.Tensor) -> TranslationState:  # prompt_ids [n] int64, target ids
        draft_ids = encode(self.draft_tokenizer, decode(self.target_tokenizer, prompt_ids.tolist()))
        inner = self.inner.start(torch.tensor(draft_ids, dtype=torch.long, device=self.device))
        return TranslationState(inner, draft_ids, prompt_ids.shape[0])

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        state: TranslationState = request.draft_state
        device = request.context.device
        context = request.context.tolist()
        state.drafted = []
        if state.synced < len(context) or not state.draft_ids:  # a character is incomplete, or no text yet
            return Draft.empty(device)
        view = DraftTokenRequest(request, state.inner, torch.tensor(state.draft_ids, dtype=torch.long,
                                                                    device=self.device))
        state.drafted = self.inner.propose(view, gamma).tokens.tolist()
        text = appended_text(self.draft_tokenizer, state.draft_ids, state.drafted, self.look_behind).rstrip(INCOMPLETE)
        if not text:
            return Draft.empty(device)
        proposal = continuation_ids(self.target_tokenizer, context, text, self.look_behind)[:gamma]
        translation = Translation(len(state.drafted), self.kept_draft_tokens(state, context, proposal))
        return Draft(torch.tensor(proposal, dtype=torch.long, device=device), None, translation=translation)

    def kept_draft_tokens(self, state: TranslationState, context: list[int], proposal: list[int]) -> int:
        """How many of the drafted tokens have their whole text in the proposal's text."""
        proposed_text = appended_text(self.target_tokenizer, context, proposal, self.look_behind)
        for count in range(len(state.drafted), 0, -1):
            text = appended_text(self.draft_tokenizer, state.draft_ids, state.drafted[:count], self.look_behind)
            if INCOMPLETE not in text and proposed_text.startswith(text):
                return count
        return 0

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        state: TranslationState = request.draft_state
        context = request.context.tolist()
        # The emitted text, less a last character whose bytes are not all there yet (it waits).
        end = len(context)
        while end > state.synced:
            text = appended_text(self.target_tokenizer, context[: state.synced], context[state.synced : end],
                                 self.look_behind)
            if not text.endswith(INCOMPLETE):
                break
            end -= 1
        if end == state.synced:
            state.drafted = []
            return
        # Re-tokenize the draft context's last tokens with the new text; keep them as they were
        # when decoding them alone does not give their text back (a split character).
        start = max(0, len(state.draft_ids) - self.look_behind)
        window_text = decode(self.draft_tokenizer, state.draft_ids[start:])
        if INCOMPLETE in window_text:
            start, window_text = len(state.draft_ids), ""
        new_ids = state.draft_ids[:start] + encode(self.draft_tokenizer, window_text + text)
        fed = state.draft_ids + state.drafted  # what the inner drafter's cache may hold, in order
        kept = start + common_prefix(fed[start:], new_ids[start:])
        state.inner.rewind(torch.tensor(new_ids, dtype=torch.long, device=self.device), kept)
        state.draft_ids, state.synced, state.drafted = new_ids, end, []
