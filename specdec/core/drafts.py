"""The one narrow interface every drafter implements, and the hand-offs in and out of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch

from specdec.core.rules import RejectionRule, SamplingRule
from specdec.core.sampling import SamplingParams
from specdec.models.base import tree_depths

#: Called after each drafted token with (tokens drafted so far, their chain probability under q);
#: True stops drafting. Draft-length policies supply it (see specdec.core.policy).
StopRule = Callable[[int, float], bool]


@dataclass(frozen=True)
class Translation:
    """What a translating drafter (another tokenizer) made of one draft: how many tokens it
    drafted in its own vocabulary, and how many of them have their whole text in the target
    tokens it proposed (the rest were cut: an incomplete character, or past gamma)."""

    proposed: int
    kept: int


@dataclass(frozen=True)
class Draft:
    """Proposed continuation (p = target, q = draft, as in Leviathan et al. 2023, Algorithm 1).
    parents is None for a chain; for a tree, parents[i] is node i's parent (-1 = the last
    committed token), parents before children, siblings in the order they were drawn.
    probs is q: for a chain, row i is the q token i was drawn from; for a tree, row 0 is q at
    the root and row i + 1 is q at node i (as verify.tree_rejection_sample takes it). None means
    deterministic guesses (point masses), or greedy decoding, where verification needs no q."""

    tokens: torch.Tensor  # [gamma] int64
    probs: torch.Tensor | None = None  # chain: [gamma, vocab]; tree: [gamma + 1, vocab]
    parents: tuple[int, ...] | None = None
    translation: Translation | None = None  # set by a drafter that translates from another tokenizer
    # [num_nodes]: the node was guessed from the cross-request cache (earlier requests' outputs) and
    # not from this request's own text; None: no node was (what users see marked in --show and explain)
    from_cache: tuple[bool, ...] | None = None
    forced: bool = False  # the tokens a request's grammar forces (specdec.grammar): accepted for certain
    drafter: str | None = None  # which of an auto drafter's candidates drafted it ("none": none did)

    @property
    def num_nodes(self) -> int:
        """Drafted tokens: a chain's length, a tree's node count (not its depth)."""
        return int(self.tokens.shape[0])

    def truncated(self, count: int) -> Draft:
        """The first ``count`` nodes (parents come before children, so a tree stays a tree)."""
        if count >= self.num_nodes:
            return self
        from_cache = None if self.from_cache is None else self.from_cache[:count]
        if self.parents is None:
            return replace(self, tokens=self.tokens[:count], probs=None if self.probs is None else self.probs[:count],
                           from_cache=from_cache)
        return replace(self, tokens=self.tokens[:count], probs=None if self.probs is None else self.probs[: count + 1],
                       parents=self.parents[:count], from_cache=from_cache)

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Draft:
        return Draft(torch.empty(0, dtype=torch.long, device=device))


@dataclass(frozen=True)
class StepOutcome:
    """What one step of one request produced, as drafters and the text layer see it."""

    emitted: torch.Tensor  # [n_accepted + 1] int64: accepted drafts, then the target's token
    num_drafted: int
    # [n_accepted + 1, features]: the target's hidden states (the drafter's hidden_layers, concatenated)
    # at the positions that predicted each emitted token (the last context token, then each accepted draft)
    hidden: torch.Tensor | None = None
    path: torch.Tensor | None = None  # [n_accepted]: tree indices of the accepted nodes (None for a chain)
    parents: tuple[int, ...] | None = None  # the drafted tree the path indexes (None for a chain)
    from_cache: tuple[bool, ...] | None = None  # the draft's (Draft.from_cache)
    forced: bool = False  # the draft was the tokens the request's grammar forces (Draft.forced)
    drafter: str | None = None  # the draft's (Draft.drafter)
    verify_seconds: float | None = None  # the step's target forward and verification (a batch's: all its requests')
    # accepted draft nodes that only a LOSSY acceptance rule accepted (specdec.core.acceptance; () when exact)
    relaxed: tuple[int, ...] = ()

    @property
    def num_accepted(self) -> int:
        return int(self.emitted.shape[0]) - 1

    @property
    def accepted_nodes(self) -> list[int]:
        """The draft nodes behind the accepted tokens, in order."""
        return list(range(self.num_accepted)) if self.path is None else self.path.tolist()

    @property
    def accepted_from_cache(self) -> int:
        """Accepted tokens that were guessed from the cross-request cache."""
        if self.from_cache is None:
            return 0
        return sum(self.from_cache[node] for node in self.accepted_nodes)


class DraftRequest(Protocol):
    """What a drafter may read of a request (the engine's Request satisfies it)."""

    draft_state: Any  # what this drafter's start() returned for the request

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def rule(self) -> SamplingRule:
        """How to draw when sampling: rule.draw(q, positions), rule.draw_distinct(q, position, count),
        with the output positions of the drawn tokens (the first drafted token's is len(context))."""

    @property
    def context(self) -> torch.Tensor: ...  # [n] int64: the prompt and every token emitted so far

    @property
    def stop_early(self) -> StopRule | None: ...  # the request's policy's rule, if it cuts drafts

    @property
    def node_budget(self) -> int | None: ...  # most tree nodes this step, if the policy sets it

    @property
    def matcher(self) -> Any:
        """A constrained request's grammar look-ahead (specdec.grammar.TokenMatcher) over the
        context's token ids; None for free text. A drafter may mask its q with it (and must
        leave it where it found it); verification masks p whatever the drafter does."""


@runtime_checkable
class Drafter(Protocol):
    """start / propose / observe. A drafter holds what is shared (weights, settings); each
    request gets its own state from start(), kept on the request. A drafter changes speed,
    never output: any tokens it proposes are verified against the target."""

    #: The vocabulary its q ranges over (None for drafters with no q, such as n-gram lookup).
    vocab_size: int | None
    #: The target layers whose outputs observe() reads in StepOutcome.hidden (a draft head's
    #: features); () for drafters that read only tokens. A drafter that reads them also has
    #: ``prefilled(request, hidden)``, called once after the prompt's prefill.
    hidden_layers: tuple[int, ...]

    def start(self, prompt_ids: torch.Tensor) -> Any:  # prompt_ids [n] int64
        """A new request's drafting state."""

    def propose(self, request: DraftRequest, gamma: int) -> Draft:
        """Up to gamma tokens continuing request.context. When sampling, tokens must be drawn
        from the returned probs (or be deterministic with probs None), or verification is not
        lossless. request.stop_early lets a policy cut a draft short; drafters without a
        probability for their guesses ignore it."""

    def observe(self, request: DraftRequest, outcome: StepOutcome) -> None:
        """After verification: request.context now ends with outcome.emitted."""


def block_parents(draft: Draft) -> tuple[int, ...] | None:
    """The verify block is [last context token, draft nodes...]: a tree's root token is node 0."""
    return None if draft.parents is None else (-1, *(parent + 1 for parent in draft.parents))


def tree_widths(parents: tuple[int, ...] | None) -> list[int] | None:
    """Nodes at each depth of a drafted tree (None for a chain)."""
    if parents is None:
        return None
    depths = tree_depths(parents)
    return [depths.count(depth) for depth in range(max(depths, default=-1) + 1)]


def block_depths(draft: Draft) -> list[int]:
    """Position offsets of the block's tokens from the last context token."""
    if draft.parents is None:
        return list(range(draft.num_nodes + 1))
    return [0, *(depth + 1 for depth in tree_depths(draft.parents))]


def propose_many(drafter: Drafter, requests: Sequence[DraftRequest], gammas: Sequence[int]) -> list[Draft]:
    """Each request's draft of up to its gamma tokens: in one call where the drafter drafts a batch
    at once (``propose_many``: a head, one forward per depth for all), else one request at a time."""
    batched = getattr(drafter, "propose_many", None)
    if callable(batched):
        return batched(requests, gammas)
    return [drafter.propose(request, gamma) for request, gamma in zip(requests, gammas, strict=True)]


class ReadsHidden(Protocol):
    """What a drafter with hidden_layers also has: the prompt's features, once, after its prefill."""

    def prefilled(self, request: DraftRequest, hidden: torch.Tensor) -> None:  # hidden [prompt - 1, features]
        """The target's hidden states (the drafter's hidden_layers) at every prompt position but the last."""


NO_DRAFT = "none"  # Draft.drafter of a step a drafter that names its drafts' drafter left undrafted


class BaseDrafter:
    """The Drafter protocol's defaults, for drafters to inherit: no q of its own (a drafter that
    has one sets vocab_size), reads no hidden states, and a class name as its description.
    start / propose / observe are each drafter's own."""

    vocab_size: int | None = None
    hidden_layers: tuple[int, ...] = ()
    #: Its drafts name the candidate that drafted each (Draft.drafter: an auto drafter's choices);
    #: the engine names a step it does not ask such a drafter to draft (no room left in the
    #: request's budget, or a server's choice of none) NO_DRAFT, so that every step has a name.
    names_drafts: bool = False

    def describe(self) -> str:
        return type(self).__name__


def node_paths(tokens: list[int], parents: Sequence[int]) -> list[tuple[int, ...]]:
    """Each node's tokens from the root down to it (parents come before children)."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents, strict=True):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def suffix_caches(drafter: object) -> list[Any]:
    """The cross-request caches a drafter keeps (suffix drafters, alone or inside others): the
    server reports their size."""
    caches = getattr(drafter, "suffix_caches", None)
    return caches() if callable(caches) else []


def describe_drafter(drafter: Drafter | None) -> str:
    """What a drafter is, in words, from the object (its describe(), else its class)."""
    if drafter is None:
        return "none (the target alone)"
    describe = getattr(drafter, "describe", None)
    return describe() if callable(describe) else type(drafter).__name__


@dataclass
class ContextRequest:
    """A DraftRequest outside the engine (tests, notebooks): a fixed context and its state."""

    context: torch.Tensor  # [n] int64
    draft_state: Any = None
    sampling: SamplingParams = SamplingParams()
    rule: SamplingRule = field(default_factory=lambda: RejectionRule(None))
    stop_early: StopRule | None = None
    node_budget: int | None = None
    matcher: Any = None

    @staticmethod
    def started(drafter: Drafter, context: torch.Tensor, **fields: Any) -> ContextRequest:
        return ContextRequest(context, drafter.start(context), **fields)


def running_banner(target: Any, drafter: Drafter | None, policy: str, gamma: int) -> str:
    """What runs, in one line, from the loaded objects (the target, the drafter) and the policy."""
    if drafter is None:
        return f"target {target.describe()}, alone (no drafter)"
    return f"target {target.describe()}; drafter: {describe_drafter(drafter)}; {policy} policy, gamma {gamma}"
