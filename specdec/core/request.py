"""A request: one sequence's state in the engine (its context, sampling, cache row, drafter state,
policy and stats); ``Isolation``, which keeps an error raised for one request of a batch to
that request; and ``VerifyHook``, which the engine tells of each request's verified step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdec.core.drafts import Draft, StopRule
from specdec.core.metrics import SpecStats
from specdec.core.policy import DraftLengthPolicy, DraftShape
from specdec.core.rules import SamplingRule
from specdec.core.sampling import SamplingParams, TokenLogprob
from specdec.core.verify_batch import Verdict
from specdec.grammar import TokenMatcher


@dataclass(eq=False)  # a request is itself: two of one prompt and settings are still two
class Request:
    """One sequence being decoded: everything the engine keeps per request."""

    prompt_ids: list[int]
    sampling: SamplingParams
    tokens: torch.Tensor  # [len(prompt) + budget] int64; the context is tokens[:length]
    length: int
    generator: torch.Generator
    rule: SamplingRule  # how it draws and verifies when sampling (specdec.core.rules)
    policy: DraftLengthPolicy | None  # None: a caller (a server's controller) chooses every step's length
    row: int  # the target cache row
    draft_state: Any = None
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None  # "eos", "stop", "max_new_tokens", "context", "cancelled"
    shape: DraftShape = DraftShape(0)  # what the policy asked of this step's draft
    matcher: TokenMatcher | None = None  # where a constrained request is in its grammar
    fed: int = 0  # prompt tokens in the cache row: the prefill is done at length - 1
    prompt_hidden: list[torch.Tensor] = field(default_factory=list)  # a chunked prefill's features so far
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per generated token, when sampling.logprobs asks

    @property
    def prefilled(self) -> bool:
        return self.fed >= len(self.prompt_ids) - 1

    @property
    def context(self) -> torch.Tensor:  # [length] int64
        return self.tokens[: self.length]

    @property
    def budget_end(self) -> int:
        return self.tokens.shape[0]

    @property
    def generated_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) : self.length].tolist()

    @property
    def stop_early(self) -> StopRule | None:
        return None if self.policy is None else self.policy.stop_early

    @property
    def node_budget(self) -> int | None:
        return self.shape.node_budget

    def truncate(self, length: int) -> None:
        """Drop context tokens past ``length`` (text after a stop string); the request is done."""
        self.length = min(self.length, length)


# What is not one request's failure: an interpreter asked to stop stops, whatever it was doing.
NOT_ISOLATED = (KeyboardInterrupt, SystemExit, GeneratorExit)


class Isolation:
    """Errors raised for one request of a batch, kept to that request. With a ``failed`` dict, an
    error inside ``of(request)`` is stored there under the request and not raised: the engine
    leaves that request out of the rest of its step and the others go on. With None, errors
    propagate (a library caller of Engine.step sees them as before).

    BaseException, not only Exception: a Rust library's panic (pyo3's PanicException, as
    llguidance raises) derives from BaseException, and would otherwise end every request."""

    def __init__(self, failed: dict[Any, BaseException] | None = None) -> None:
        self.failed = failed

    @contextlib.contextmanager
    def of(self, request: Request) -> Iterator[None]:
        if self.failed is None:
            yield
            return
        try:
            yield
        except NOT_ISOLATED:
            raise
        except BaseException as error:  # noqa: BLE001 - one request's failure, whatever it is (see above)
            self.failed[request] = error

    def alive(self, request: Request) -> bool:
        return self.failed is None or request not in self.failed


PASS_THROUGH = Isolation()  # errors propagate (no failed dict): stateless, one instance serves every call


class VerifyHook(Protocol):
    """Told of each request's verified step, before its tokens join the context (``specdec
    explain`` records steps through it); the verdict keeps the sampler's decision."""

    def __call__(self, request: Request, draft: Draft, target_logits: torch.Tensor,  # [nodes + 1, vocab]
                 verdict: Verdict, draft_seconds: float, verify_seconds: float) -> None: ...
