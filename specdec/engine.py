"""The decoding loop: draft, verify in one target forward, commit, stream.

Invariant between steps: the target's cache holds every context token but the last one, which
is fed together with the next draft. So one step is a single target forward on
[last token, d_1 .. d_gamma] at positions [L-1 .. L-1+gamma], giving p for every draft position
plus the bonus position, and plain decoding is the same step with an empty draft.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdec.drafting.base import Draft, Drafter
from specdec.drafting.model import ModelDrafter
from specdec.metrics import SpecStats
from specdec.models.base import LanguageModel
from specdec.policy import DraftLengthPolicy, make_policy
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.verify import greedy_verify, rejection_sample


class TokenSource(str, enum.Enum):
    """How an emitted token came about (what `specdec generate --show` colours)."""

    DRAFT = "draft"  # proposed by the drafter, accepted by the target
    CORRECTION = "correction"  # the target's token where it rejected a draft
    BONUS = "bonus"  # the target's extra token after every draft was accepted
    TARGET = "target"  # plain decoding: nothing was drafted this step


@dataclass
class StreamChunk:
    """The tokens one step emitted (after stop conditions), with their text."""

    token_ids: list[int] = field(default_factory=list)
    sources: list[TokenSource] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # the text each token added
    result: GenerationResult | None = None  # set on the last chunk only

    @property
    def text(self) -> str:
        return "".join(self.token_texts)

    def truncate_text(self, excess: int) -> None:
        """Drop the last ``excess`` characters of this chunk (text from a stop string on)."""
        for index in reversed(range(len(self.token_texts))):
            if excess <= 0:
                break
            piece = self.token_texts[index]
            keep = max(0, len(piece) - excess)
            excess -= len(piece) - keep
            self.token_texts[index] = piece[:keep]


@dataclass(frozen=True)
class StepOutcome:
    """What one speculative step produced."""

    emitted: torch.Tensor  # [n_accepted + 1] int64: accepted drafts, then the target's token
    num_drafted: int

    @property
    def num_accepted(self) -> int:
        return int(self.emitted.shape[0]) - 1

    def source(self, index: int) -> TokenSource:
        """How the index-th emitted token came about."""
        if index < self.num_accepted:
            return TokenSource.DRAFT
        if self.num_drafted == 0:
            return TokenSource.TARGET
        return TokenSource.BONUS if self.num_accepted == self.num_drafted else TokenSource.CORRECTION


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only (an EOS that ended generation included)
    prompt_ids: list[int]
    finish_reason: str  # "eos", "stop", "max_new_tokens" or "context"
    stats: SpecStats = field(default_factory=SpecStats)


class IncrementalDetokenizer:
    """Text deltas for a growing list of ids, without re-decoding everything each time.
    A delta is held back while it ends in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


def as_drafter(drafter: Drafter | LanguageModel | None) -> Drafter | None:
    """A loaded draft model is wrapped in a ModelDrafter; drafters pass through."""
    return ModelDrafter(drafter) if isinstance(drafter, LanguageModel) else drafter


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``drafter`` proposing ``gamma`` tokens a step.

    drafter may be a Drafter, a LanguageModel (wrapped in a ModelDrafter) or None, which gives
    plain target-only decoding through the same loop (the baseline).
    """

    def __init__(
        self,
        target: LanguageModel,
        drafter: Drafter | LanguageModel | None = None,
        gamma: int = 4,
        policy: str | DraftLengthPolicy = "fixed",
    ) -> None:
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.policy = make_policy(policy, gamma) if isinstance(policy, str) else policy
        self.target = target
        self.drafter = as_drafter(drafter)
        draft_vocab = getattr(self.drafter, "vocab_size", None)
        if draft_vocab is not None and draft_vocab != target.vocab_size:
            raise ValueError(
                f"draft and target vocabularies differ: the draft has {draft_vocab} tokens, "
                f"the target {target.vocab_size}; speculative decoding needs one shared vocabulary"
            )
        self.target_cache = target.new_cache()

    # ----------------------------------------------------------------------------------------
    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.target.tokenizer is None:
                raise ValueError(f"{self.target.name} has no tokenizer; pass the prompt as token ids")
            ids = self.target.tokenizer.encode(prompt)
        else:
            ids = [int(token) for token in prompt]
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if len(ids) >= self.target.max_context:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the context holds {self.target.max_context}: "
                "no room to generate; shorten the prompt"
            )
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{self.target.vocab_size - 1})")
        return ids

    def step(
        self,
        context: torch.Tensor,  # [L] int64, the whole sequence so far
        gamma: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        stats: SpecStats,
    ) -> StepOutcome:
        """One speculative step: draft, one target forward, verify, roll back the target cache."""
        started = time.perf_counter()
        if gamma > 0:
            draft = self.drafter.propose(context, gamma, sampling, generator, stop_early=self.policy.stop_early)
        else:
            draft = Draft.empty(context.device)
        drafted_at = time.perf_counter()
        block = torch.cat([context[-1:], draft.tokens])  # [gamma + 1] at positions L-1 .. L-1+gamma
        target_logits = self.target.forward(block, self.target_cache)  # [gamma + 1, vocab]
        if sampling.greedy:
            emitted = greedy_verify(draft.tokens, target_logits)
        else:
            target_probs = logits_to_probs(target_logits, sampling)  # [gamma + 1, vocab]
            emitted = rejection_sample(draft.tokens, draft.probs, target_probs, generator)
        n_accepted = emitted.shape[0] - 1
        # Keep the cache entries of the last context token and the accepted drafts only.
        self.target_cache.crop(context.shape[0] + n_accepted)
        draft_seconds, verify_seconds = drafted_at - started, time.perf_counter() - drafted_at
        if self.drafter is not None:
            self.drafter.observe(draft.gamma, n_accepted)
            self.policy.update(draft.gamma, n_accepted, draft_seconds, verify_seconds)
        stats.observe(draft.gamma, n_accepted)
        stats.draft_seconds += draft_seconds
        stats.verify_seconds += verify_seconds
        return StepOutcome(emitted, draft.gamma)

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield the tokens of each step as they are verified; the last chunk holds the result."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        prompt_ids = self._encode(prompt)
        stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        generator = torch.Generator(device=self.target.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
        device = self.target.device
        stats = SpecStats(prompt_tokens=len(prompt_ids))
        started = time.perf_counter()

        budget = min(max_new_tokens, self.target.max_context - len(prompt_ids))
        context = torch.empty(len(prompt_ids) + budget, dtype=torch.long, device=device)
        context[: len(prompt_ids)] = torch.tensor(prompt_ids, device=device)
        length = len(prompt_ids)
        self.target_cache.reset()
        self.target_cache.reserve(context.shape[0])
        if self.drafter is not None:
            self.drafter.reset()
        if length > 1:  # prefill all but the last prompt token, which the first step feeds
            self.target.forward(context[: length - 1], self.target_cache)
        stats.prefill_seconds = time.perf_counter() - started

        detokenizer = IncrementalDetokenizer(self.target.tokenizer)
        eos = set(self.target.eos_token_ids)
        finish_reason = None
        while finish_reason is None:
            remaining = len(prompt_ids) + budget - length
            gamma = min(self.policy.next_gamma(), remaining - 1) if self.drafter is not None else 0
            outcome = self.step(context[:length], gamma, sampling, generator, stats)
            chunk = StreamChunk()
            for index, token in enumerate(outcome.emitted.tolist()):
                context[length] = token
                length += 1
                chunk.token_ids.append(token)
                chunk.sources.append(outcome.source(index))
                text_before = len(detokenizer.text)
                chunk.token_texts.append(detokenizer.push(token))
                finish_reason = self._finish_reason(token, detokenizer.text, text_before, stops, eos,
                                                    length - len(prompt_ids), budget, max_new_tokens)
                if finish_reason is not None:
                    break
            stats.generated_tokens = length - len(prompt_ids)
            if finish_reason is not None:
                stats.total_seconds = time.perf_counter() - started
                text = detokenizer.text
                if finish_reason == "stop":
                    cut = min(i for i in (text.find(s) for s in stops) if i >= 0)
                    chunk.truncate_text(len(text) - cut)
                    text = text[:cut]
                chunk.result = GenerationResult(
                    text=text, token_ids=context[len(prompt_ids) : length].tolist(), prompt_ids=prompt_ids,
                    finish_reason=finish_reason, stats=stats,
                )
            yield chunk

    @staticmethod
    def _finish_reason(token: int, text: str, text_before: int, stops: list[str], eos: set[int],
                       generated: int, budget: int, max_new_tokens: int) -> str | None:
        if token in eos:
            return "eos"
        # A stop string newly completed must end inside the text this token added.
        if any(s in text[max(0, text_before - len(s) + 1) :] for s in stops):
            return "stop"
        if generated >= budget:
            return "max_new_tokens" if generated >= max_new_tokens else "context"
        return None

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """Decode to the end; keyword arguments as for ``stream``."""
        for chunk in self.stream(prompt, **kwargs):
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a result")
