"""SpeculativeDecoder: the public API. Text in, text out, one request or a batch; the engine
underneath sees token ids only, and the text layer (specdec.text) sits on top of it."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any, cast, overload

from specdec.assembly import build_engine, engine_of
from specdec.config import SpeculationConfig
from specdec.core.drafts import Drafter
from specdec.core.engine import Engine
from specdec.core.estimates import CostModel
from specdec.core.policy import DraftLengthPolicy
from specdec.core.sampling import SamplingParams
from specdec.models.base import LanguageModel
from specdec.models.paged_cache import BLOCK_SIZE
from specdec.text import GenerationResult, StreamChunk, TextStream, encode_prompt, step_chunk, with_prediction_ids

Prompt = str | Sequence[int]
SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


def sampling_params(sampling: SamplingParams | None, options: dict) -> SamplingParams:
    """SamplingParams from either the dataclass or its fields as keyword arguments."""
    unknown = set(options) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown generation options {sorted(unknown)}; known: {sorted(SAMPLING_FIELDS)}")
    if sampling is not None and options:
        raise TypeError("pass either sampling=SamplingParams(...) or its fields as keywords, not both")
    return sampling if sampling is not None else SamplingParams(**options)


def is_batch(prompt: Prompt | Sequence[Prompt]) -> bool:
    """A list of strings or of id lists is a batch; a string or a list of ints is one prompt."""
    return not isinstance(prompt, str) and len(prompt) > 0 and not isinstance(prompt[0], int)


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``drafter`` proposing ``gamma`` tokens a step.

    drafter may be a Drafter, a LanguageModel (wrapped in a ModelDrafter), a name of a drafter that
    needs no draft model ("auto": every such drafter and the head found for the target, each step's
    best; "suffix", "ngram", ...) or None, which gives plain target-only decoding through the same
    loop (the baseline). policy is a name or a policy object that every request copies (unset:
    "auto" for the auto drafter, which then drafts up to gamma = 12, else "fixed" with gamma 4).
    draft_forced: a constrained request's forced tokens (specdec.grammar) are drafted before asking
    the drafter (off only to measure what they bring).
    prefill_chunk: a prompt is prefilled in pieces of that many tokens (Engine.prefill), as a
    server with that chunk prefills it (the same cache bits); None: in one piece.
    costs: the cost model that decides how much to draft (its clock times every measurement;
    None: a fresh one, or the drafter's own when it brings one).
    Every generate() or stream() call has its own cache rows, so calls never disturb each other.
    """

    def __init__(
        self,
        target: LanguageModel,
        drafter: Drafter | LanguageModel | str | None = None,
        gamma: int | None = None,
        policy: str | DraftLengthPolicy | None = None,
        draft_forced: bool = True,
        prefill_chunk: int | None = None,
        costs: CostModel | None = None,
    ) -> None:
        self.engine = engine_of(target, drafter, gamma, policy, draft_forced, prefill_chunk=prefill_chunk,
                                costs=costs)
        self.target = target

    @classmethod
    def from_config(cls, target: LanguageModel, config: SpeculationConfig, draft: LanguageModel | None = None,
                    head: Any = None, corpus: Sequence[Any] = ()) -> SpeculativeDecoder:
        """The decoder ``config`` describes, on loaded models (specdec.assembly.build_engine: ``draft``
        a draft model for the drafters that take one; ``head`` a DraftHead or folder, else the
        config's draft_head, else the head found for the target where one may draft; ``corpus``
        datastores)."""
        return cls.from_engine(build_engine(target, config, draft=draft, head=head, corpus=corpus))

    @classmethod
    def from_engine(cls, engine: Engine) -> SpeculativeDecoder:
        """A decoder around an engine build_engine assembled."""
        decoder = cls.__new__(cls)
        decoder.engine, decoder.target = engine, engine.target
        return decoder

    @property
    def drafter(self) -> Drafter | None:
        return self.engine.drafter

    def stream(self, prompt: Prompt, sampling: SamplingParams | None = None, **options) -> Iterator[StreamChunk]:
        """Yield the tokens of each step as they are verified; the last chunk holds the result.
        Options are SamplingParams fields (temperature, top_k, top_p, min_p, seed,
        max_new_tokens, stop)."""
        for _, chunk in self.run([prompt], [sampling_params(sampling, options)]):
            yield chunk

    @overload
    def generate(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                 **options: Any) -> GenerationResult: ...

    @overload
    def generate(self, prompt: list[str] | list[Sequence[int]] | list[list[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 **options: Any) -> list[GenerationResult]: ...

    def generate(
        self, prompt: Prompt | Sequence[Prompt], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        **options: Any,
    ) -> GenerationResult | list[GenerationResult]:
        """Decode to the end. A list of prompts is decoded as one batch (one target forward per
        step for all of them) and gives a list of results in order; sampling may then be a list
        with one SamplingParams per prompt."""
        prompts = cast(list[Prompt], list(prompt) if is_batch(prompt) else [prompt])
        if isinstance(sampling, Sequence):
            if len(sampling) != len(prompts):
                raise ValueError(f"{len(sampling)} SamplingParams for {len(prompts)} prompts")
            samplings = [sampling_params(s, options) for s in sampling]
        else:
            samplings = [sampling_params(sampling, options)] * len(prompts)
        results: dict[int, GenerationResult] = {}
        for index, chunk in self.run(prompts, samplings):
            if chunk.result is not None:
                results[index] = chunk.result
        ordered = [results[index] for index in range(len(prompts))]  # run() ends every prompt with a result
        return ordered if is_batch(prompt) else ordered[0]

    def run(self, prompts: Sequence[Prompt], samplings: Sequence[SamplingParams]) -> Iterator[tuple[int, StreamChunk]]:
        """Decode the prompts together; yield (prompt index, chunk) after every step."""
        if not prompts:
            raise ValueError("no prompts given")
        started = time.perf_counter()
        tokenizer = self.target.tokenizer
        samplings = [with_prediction_ids(sampling, tokenizer, self.target.name) for sampling in samplings]
        requests = [self.engine.new_request(encode_prompt(tokenizer, prompt, self.target.name), sampling, row)
                    for row, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True))]
        texts = [TextStream(tokenizer, sampling.stop) for sampling in samplings]
        # One pool of what the requests can reach (models/paged_cache.py), as a server's; doubled
        # if a tree's extra nodes ever need more.
        tokens = sum(request.budget_end for request in requests) + BLOCK_SIZE * len(requests)
        cache = (self.target.new_paged_cache(len(requests), tokens, growable=True)
                 or self.target.new_cache(rows=len(requests)))
        self.engine.prefill(requests, cache)
        active = list(requests)
        while active:
            lengths = [request.length for request in active]
            outcomes = self.engine.step(active, cache)
            for request, outcome, length in zip(active, outcomes, lengths, strict=True):
                yield request.row, step_chunk(request, outcome, length, texts[request.row], started)
            active = [request for request in active if request.finish_reason is None]
