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

Sampling, lossless by two rules (docs/tokenizers.md):
- "point-mass" (the default): the greedy text translation above, handed on as deterministic
  guesses (Draft.probs None). Verification accepts a guess x with probability p(x) and
  otherwise samples from p without x, renormalized (the residual max(0, p - 1_x)): the emitted
  token has law p(x) 1{y = x} + (1 - p(x)) p(y) 1{y != x} / (1 - p(x)) = p(y) for every y,
  whatever x is, as long as x was chosen without looking at the uniform draws that judge it.
  The draft guesses greedily because a point mass on x is accepted with probability p(x).
- "intersection" (Timor et al., ICML 2025, token-level intersection): the draft samples from
  its q restricted to the tokens whose strings both vocabularies have, renormalized (q'); each
  drafted token is then exactly one target token, q' moves to the target's rows, and the usual
  rejection sampling with q' keeps p exactly, since the tokens were drawn from q'. Without any
  shared token the point-mass rule is used.
Greedy requests always take the text translation: greedy verification accepts a guess only
where it equals the target's argmax, and the draft is not confined to the shared tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.core.drafts import BaseDrafter, Draft, DraftRequest, StepOutcome, Translation
from specdec.core.sampling import SamplingParams
from specdec.drafting.merge import SubRequest
from specdec.drafting.model import DraftModelState, ModelDrafter, common_prefix
from specdec.drafting.vocab import SharedLogits, shared_token_map
from specdec.models.base import LanguageModel
from specdec.names import VOCAB_RULES

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


@dataclass
class TranslationState:
    """One request: the inner drafter's state and the context in the draft's tokens."""

    inner: DraftModelState
    draft_ids: list[int]  # the text of the target context's first `synced` tokens, in draft ids
    synced: int  # target context tokens whose text is in draft_ids
    drafted: list[int] = field(default_factory=list)  # this step's draft, in draft ids


@dataclass
class DraftTokenRequest(SubRequest):
    """The inner drafter's view of a request: the context in draft ids, its own state, and how
    it samples (greedy guesses for text translation, the request's own for the intersection)."""

    draft_context: torch.Tensor | None = None  # [n] int64, draft ids
    draft_sampling: SamplingParams = GREEDY

    @property
    def context(self) -> torch.Tensor:
        assert self.draft_context is not None, "a draft-token view is built with its context"
        return self.draft_context

    @property
    def sampling(self) -> SamplingParams:
        return self.draft_sampling

    @property
    def matcher(self) -> None:
        """The grammar reads target ids; this context is in draft ids (verification still masks p)."""
        return None




class TranslatingDrafter(BaseDrafter):
    """A draft model of another tokenizer as a drafter in the target's token ids (see the module
    docstring). Greedy requests get the draft's greedy text re-encoded; sampled requests get
    the same as point masses (vocab_rule "point-mass", the default: measured to accept more
    on SmolLM2 -> Qwen2.5-Coder, docs/tokenizers.md), or with "intersection" tokens sampled from
    q restricted to the shared tokens. look_behind is the number of context tokens decoded and
    re-encoded with each piece of new text."""

    vocab_size: int | None = None  # q, where there is one, is built over the target's rows

    def __init__(self, draft: LanguageModel, target: LanguageModel, look_behind: int = 4,
                 vocab_rule: str = "point-mass") -> None:
        if draft.tokenizer is None or target.tokenizer is None:
            raise ValueError("translating between vocabularies needs both models' tokenizers")
        if look_behind < 1:
            raise ValueError(f"look_behind must be >= 1, got {look_behind}")
        if vocab_rule not in VOCAB_RULES:
            raise ValueError(f"unknown vocabulary rule {vocab_rule!r}; choose one of {', '.join(VOCAB_RULES)}")
        self.inner, self.look_behind, self.vocab_rule = ModelDrafter(draft), look_behind, vocab_rule
        self.draft_tokenizer, self.target_tokenizer = draft.tokenizer, target.tokenizer
        self.target_rows, self.device = target.vocab_size, draft.device
        self.shared_draft = None  # the draft with its logits off the shared tokens masked ("intersection")
        if vocab_rule == "intersection":
            self.to_target = shared_token_map(draft.tokenizer, target.tokenizer, draft.vocab_size).to(draft.device)
            if bool((self.to_target >= 0).any()):
                self.shared_draft = dataclasses.replace(draft, network=SharedLogits(draft.network, self.to_target >= 0))

    def describe(self) -> str:
        return f"draft model {self.inner.model.name}, another tokenizer (translated; {self.vocab_rule} when sampling)"

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
        draft_context = torch.tensor(state.draft_ids, dtype=torch.long, device=self.device)
        if self.shared_draft is not None and not request.sampling.greedy:
            return self.propose_shared(request, DraftTokenRequest(request, state.inner, draft_context,
                                                                  request.sampling), gamma)
        greedy_view = DraftTokenRequest(request, state.inner, draft_context)
        state.drafted = self.inner.propose(greedy_view, gamma).tokens.tolist()
        text = appended_text(self.draft_tokenizer, state.draft_ids, state.drafted, self.look_behind).rstrip(INCOMPLETE)
        if not text:
            return Draft.empty(device)
        proposal = continuation_ids(self.target_tokenizer, context, text, self.look_behind)[:gamma]
        translation = Translation(len(state.drafted), self.kept_draft_tokens(state, context, proposal))
        return Draft(torch.tensor(proposal, dtype=torch.long, device=device), None, translation=translation)

    def propose_shared(self, request: DraftRequest, view: DraftTokenRequest, gamma: int) -> Draft:
        """Token-level intersection: the draft samples from q restricted to the shared tokens and
        renormalized (q' = 0 off them), each drafted token is one target token, and q' moves
        to the target's rows: verification then sees the very q' the tokens were drawn from."""
        state: TranslationState = request.draft_state
        assert self.shared_draft is not None, "only the intersection rule with shared tokens proposes here"
        state.inner.model = self.shared_draft  # the same weights and cache, logits off the shared tokens masked
        draft = self.inner.propose(view, gamma)
        state.drafted = draft.tokens.tolist()
        if draft.num_nodes == 0:
            return Draft.empty(request.context.device)
        tokens = self.to_target[draft.tokens]
        assert draft.probs is not None, "a sampled draft carries its q"
        probs = draft.probs.new_zeros(draft.num_nodes, self.target_rows)  # [gamma, target rows]
        shared = self.to_target >= 0
        probs[:, self.to_target[shared]] = draft.probs[:, shared]
        translation = Translation(draft.num_nodes, draft.num_nodes)
        return Draft(tokens.to(request.context.device), probs.to(request.context.device), translation=translation)

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
