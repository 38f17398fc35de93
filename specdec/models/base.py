"""What the engine needs of a model, whichever forward runs it.

One call scores a ragged batch: every request's new tokens flattened into one block, with
explicit positions, the cache row each segment belongs to, and for each segment whether its
tokens form a causal chain or a tree. The forward writes the new keys and values past each
row's committed length and does not commit them: the engine decides, after verification, what
to keep (``commit``, ``rollback``, ``compact``). Everything past a row's length is garbage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Segment:
    """One request's new tokens inside a forward.

    parents is None for a causal chain (token i sees the committed context and new tokens
    0..i); for a tree, parents[i] is the index (within the tree) of node i's parent, or -1
    for a node that hangs off the committed context. Nodes come in topological order
    (parents[i] < i) and each sees the committed context, its ancestors and itself.
    A tree can grow over several forwards: ``written`` nodes were written past the committed
    length by earlier forwards (and not committed); this forward's tokens are nodes
    written .. written + count - 1, and parents covers all of them.
    """

    row: int  # cache row
    count: int  # new tokens
    parents: tuple[int, ...] | None = None
    written: int = 0

    def __post_init__(self) -> None:
        if self.parents is None and self.written:
            raise ValueError("only a tree can extend nodes written by an earlier forward")
        if self.parents is not None:
            if len(self.parents) != self.written + self.count:
                raise ValueError(f"a tree of {self.written + self.count} nodes needs as many parents, "
                                 f"got {len(self.parents)}")
            bad = [i for i, parent in enumerate(self.parents) if not -1 <= parent < i]
            if bad:
                raise ValueError(f"tree parents must satisfy -1 <= parents[i] < i; nodes {bad} do not")


@dataclass(frozen=True)
class Attention:
    """Who sees what in one forward: segments in the order of the flattened tokens."""

    segments: tuple[Segment, ...]
    # Score every token bit-for-bit as it would be scored alone, whatever else is in the block
    # (the target's verify blocks need it for exact greedy equality; a drafter's forwards do not:
    # a draft only changes speed). Models whose kernels are batch-invariant anyway ignore it.
    batch_invariant: bool = True
    offsets: list[int] = field(init=False, repr=False, compare=False)  # segment s owns tokens offsets[s]:offsets[s + 1]

    def __post_init__(self) -> None:
        offsets = [0]
        for segment in self.segments:
            offsets.append(offsets[-1] + segment.count)
        object.__setattr__(self, "offsets", offsets)

    @staticmethod
    def chain(count: int, row: int = 0, batch_invariant: bool = True) -> Attention:
        return Attention((Segment(row, count),), batch_invariant)

    @staticmethod
    def tree(parents: Sequence[int], row: int = 0, batch_invariant: bool = True) -> Attention:
        return Attention((Segment(row, len(parents), tuple(parents)),), batch_invariant)

    @property
    def num_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def has_trees(self) -> bool:
        return any(segment.parents is not None for segment in self.segments)


def tree_visibility(parents: Sequence[int]) -> torch.Tensor:  # [n, n] bool
    """visible[i, j]: node j is node i or one of its ancestors."""
    count = len(parents)
    visible = torch.eye(count, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            visible[node] |= visible[parent]
    return visible


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node below the committed context (a root node has depth 0)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [n, vocab] (None when not asked for, as in a prefill)
    # [n, len(hidden_layers) * hidden]: the outputs of the decoder layers asked for, concatenated in
    # the order asked (what a draft head reads, EAGLE-3's features); None when none were asked for.
    hidden: torch.Tensor | None = None


class Cache(Protocol):
    """Attention state of ``rows`` sequences. Row r holds lengths[r] committed positions; a
    forward writes new tokens after them, and these verbs decide what stays."""

    rows: int
    max_length: int
    lengths: list[int]

    def reserve(self, capacity: int) -> None: ...
    def ensure(self, row: int, length: int) -> None: ...  # room for row's slots up to length (a paged cache
    # takes blocks, and raises CacheFullError when none is left)
    def commit(self, row: int, count: int) -> None: ...
    def rollback(self, row: int, length: int) -> None: ...
    def compact(self, row: int, keep: Sequence[int]) -> None: ...


@runtime_checkable
class ForkingCache(Cache, Protocol):
    """A cache whose row can start as a copy of another's prefix (KVCache; the llama.cpp and
    transformers backends' caches cannot: their requests each prefill)."""

    def fork(self, source: int, row: int, length: int) -> None: ...


class Network(Protocol):
    """A causal LM forward that keeps all per-sequence state in a cache it creates."""

    def new_cache(self, max_length: int, rows: int = 1) -> Cache: ...

    def __call__(
        self,
        tokens: torch.Tensor,  # [n] int64, every segment's new tokens, flattened
        positions: torch.Tensor,  # [n] int64, absolute positions (depth in a tree + committed length)
        cache: Cache,
        attention: Attention,
        want_logits: bool = True,
        hidden_layers: tuple[int, ...] = (),  # decoder layers whose outputs to return (ForwardOutput.hidden)
    ) -> ForwardOutput: ...


def check_hidden_layers(hidden_layers: Sequence[int], num_layers: int) -> None:
    bad = [index for index in hidden_layers if not 0 <= index < num_layers]
    if bad:
        raise ValueError(f"hidden states asked of layers {bad}; the model has layers 0..{num_layers - 1}")


def check_forward(tokens: torch.Tensor, positions: torch.Tensor, cache: Cache, attention: Attention) -> None:
    """The checks every Network makes before writing anything."""
    if tokens.shape != positions.shape or tokens.dim() != 1:
        raise ValueError(
            f"tokens {tuple(tokens.shape)} and positions {tuple(positions.shape)} must be equal 1-D shapes")
    if attention.num_tokens != tokens.shape[0]:
        raise ValueError(f"attention covers {attention.num_tokens} tokens, the block has {tokens.shape[0]}")
    for segment in attention.segments:
        if not 0 <= segment.row < cache.rows:
            raise ValueError(f"cache row {segment.row} does not exist (the cache has {cache.rows})")
        end = cache.lengths[segment.row] + segment.written + segment.count
        if end > cache.max_length:
            raise ValueError(f"position {end - 1} is past the context length {cache.max_length}")


@dataclass
class LanguageModel:
    """A loaded model: its forward, its tokenizer and what the engine must know about it."""

    network: Network
    tokenizer: Any  # a transformers tokenizer, or None for token-id-only use
    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    backend: str = "specdec"  # "specdec" (own forward) or "transformers" (adapter)
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    path: str | None = None  # the folder it was loaded from

    def new_cache(self, rows: int = 1, max_length: int | None = None) -> Cache:
        """A cache of ``rows`` rows, each up to ``max_length`` positions (default: the context)."""
        return self.network.new_cache(max_length or self.max_context, rows)

    def new_paged_cache(self, rows: int, pool_tokens: int, max_length: int | None = None,
                        growable: bool = False) -> Cache | None:
        """Rows that share one pool of ``pool_tokens`` tokens (models/paged_cache.py; ``growable``:
        doubled when it runs dry, else CacheFullError); None for a network without one (llama.cpp's
        and transformers' caches are their own)."""
        make = getattr(self.network, "new_paged_cache", None)  # an optional verb of a Network
        return None if make is None else make(rows, pool_tokens, max_length or self.max_context, growable)

    @property
    def precision(self) -> str:
        """What the weights compute in: int8, a float dtype, or GGUF (llama.cpp keeps the file's types)."""
        if self.backend == "llama.cpp":
            return "GGUF"
        quantized = getattr(self.network, "quantized", False)  # "int8" / "int4" once quantized
        return quantized if isinstance(quantized, str) else str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        """The model as it runs: name, backend, precision, device."""
        return f"{self.name} ({self.backend} backend, {self.precision}, {self.device})"

    def forward(
        self,
        tokens: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        cache: Cache,
        attention: Attention,
        want_logits: bool = True,
        hidden_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        return self.network(tokens, positions, cache, attention, want_logits, hidden_layers)

    def extend(self, tokens: torch.Tensor, cache: Cache, row: int = 0, batch_invariant: bool = True) -> torch.Tensor:
        """Feed a chain of tokens [k] after row's committed context and commit them; logits [k, vocab].
        The plain left-to-right use (prefills, draft models, tests)."""
        start = cache.lengths[row]
        positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
        logits = self.forward(tokens, positions, cache, Attention.chain(tokens.shape[0], row, batch_invariant)).logits
        assert logits is not None  # want_logits defaults to True
        cache.commit(row, tokens.shape[0])
        return logits
