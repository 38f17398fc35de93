"""Structured output's machinery: token masks, look-ahead along a draft, forced tokens (llguidance).

The constrained target law is p masked to the tokens the grammar allows next and renormalised; the
mask goes on the logits, before temperature / top-k / top-p (as in vLLM and llama.cpp), so a
constrained request samples, and greedy picks, among allowed tokens only. Speculation stays
lossless for that law: verification masks p at every drafted position with the matcher advanced
along the drafted path (and rolled back after), so rejection sampling against any q gives exactly
the masked law, and greedy gives the target alone's constrained greedy text. Where the grammar
leaves one continuation (keys, punctuation, closing brackets), the masked p is a point mass: those
tokens are drafted for nothing (``TokenMatcher.forced``) and always accepted.

llguidance: JSON schema, regex, Lark and GBNF grammars; its per-token mask is cheap beside a forward
(docs/structured.md has the measured cost), it rolls back, and it reports forced tokens.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from specdec.constraint import Constraint, ConstraintError, engine_message


def hf_fast_tokenizer(tokenizer: Any, model_path: str | None) -> Any:
    """The transformers fast tokenizer behind a model: its own, or for a GGUF run on llama.cpp
    the one transformers reads from the file."""
    if hasattr(tokenizer, "backend_tokenizer"):
        return tokenizer
    if model_path and model_path.endswith(".gguf"):
        from transformers import AutoTokenizer

        path = Path(model_path)
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    raise ConstraintError("structured output needs the target's tokenizer as a Hugging Face fast tokenizer; "
                          "this model has none")


# Forced tokens a new matcher walks (on a copy) before its request runs: enough to reach a lexer
# limit that the first tokens hit, little time for ordinary grammars (GrammarCompiler.matcher).
PROBE_TOKENS = 64


class GrammarCompiler:
    """llguidance's view of one target's vocabulary (about a second to build for 150k tokens, so
    one per model), and a matcher per request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 model_path: str | None = None) -> None:
        import llguidance
        import llguidance.hf

        fast = hf_fast_tokenizer(tokenizer, model_path)
        eos = list(eos_token_ids) or [fast.eos_token_id]
        self.tokenizer = llguidance.hf.from_tokenizer(fast, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos)

    def matcher(self, constraint: Constraint, probe: int = PROBE_TOKENS) -> TokenMatcher:
        """A matcher at the start of ``constraint``, or a ConstraintError naming why the engine refuses
        it. Some refusals come only once tokens flow (a regex like a{1000000} builds, then its lexer
        gives up on the first token): a copy walks the first ``probe`` tokens the grammar forces, so
        those are refused here too, before the request runs. Errors are one line (no parser state)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, constraint.llguidance_grammar(),
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        walk = matcher
        if not matcher.is_error() and probe:
            walk = matcher.deep_copy()
            walk.consume_tokens(walk.compute_ff_tokens()[:probe])
            walk.compute_bitmask()
        if walk.is_error():
            raise ConstraintError(f"{constraint.describe()}: {engine_message(walk.get_error())}")
        return TokenMatcher(matcher, self.vocab_size, self.eos_token_ids)


_COMPILERS: dict[int, GrammarCompiler] = {}  # id(model) -> its compiler, while the model lives
_BUILDING = threading.Lock()  # a server compiles on worker threads: one compiler per model all the same


def compiler_for(model: Any) -> GrammarCompiler:
    """The model's GrammarCompiler, built on first use and kept while the model lives."""
    with _BUILDING:
        compiler = _COMPILERS.get(id(model))
        if compiler is None:
            compiler = GrammarCompiler(model.tokenizer, model.vocab_size, tuple(model.eos_token_ids),
                                       getattr(model, "path", None))
            _COMPILERS[id(model)] = compiler
            weakref.finalize(model, _COMPILERS.pop, id(model), None)
    return compiler


Result = TypeVar("Result")


def timed(method: Callable[..., Result]) -> Callable[..., Result]:
    """Adds a TokenMatcher method's time to its ``seconds`` (only the outermost of nested calls)."""

    @functools.wraps(method)
    def run(self: TokenMatcher, *args: Any) -> Result:
        if self.timing:
            return method(self, *args)
        self.timing, started = True, time.perf_counter()
        try:
            return method(self, *args)
        finally:
            self.timing = False
            self.seconds += time.perf_counter() - started

    return run


class TokenMatcher:
    """One request's place in its grammar: which tokens may come next, and the tokens forced.
    Verbs on token ids only; speculation looks ahead along a draft and rolls back."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.matcher, self.vocab_size, self.eos_token_ids = matcher, vocab_size, eos_token_ids
        self.bit = torch.arange(32, dtype=torch.int32)
        self.walked = 0  # tokens look_ahead has consumed since end_look_ahead
        self.seconds, self.timing = 0.0, False  # time in the grammar engine since take_seconds
        self.draft_forced = True  # forced tokens join drafts (the engine's draft_forced; off to measure them)

    def copy(self) -> TokenMatcher:
        """Another matcher at the same place (one per choice of a request: each walks its own text)."""
        twin = TokenMatcher(self.matcher.deep_copy(), self.vocab_size, self.eos_token_ids)
        twin.draft_forced = self.draft_forced
        return twin

    def take_seconds(self) -> float:
        """The time spent in the grammar engine since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    @timed
    def allowed(self) -> torch.Tensor:  # [vocab] bool
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        return ((words[:, None] >> self.bit) & 1).flatten()[: self.vocab_size].bool()

    @timed
    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar accepts in a row from here (the state is unchanged)."""
        return int(self.matcher.validate_tokens(tokens)) if tokens else 0

    @timed
    def consume(self, tokens: list[int]) -> None:
        """Advance past ``tokens`` (an end token only last: a complete grammar has stopped and
        takes no end token, an incomplete one takes it where it may end)."""
        body = tokens[:-1] if tokens and tokens[-1] in self.eos_token_ids else tokens
        refused = bool(body) and not self.matcher.consume_tokens(body)
        if len(body) < len(tokens) and not refused and not self.matcher.is_stopped():
            refused = not self.matcher.consume_token(tokens[-1])
        if refused:
            raise ConstraintError(f"the grammar engine stopped: {engine_message(self.matcher.get_error())}")

    @timed
    def rollback(self, count: int) -> None:
        if count:
            self.matcher.rollback(count)

    def mask_draft_logits(
        self,
        logits: torch.Tensor,  # [1, draft vocab]: a draft model's, whose ids are the target's (padding aside)
    ) -> torch.Tensor:  # [1, draft vocab], disallowed tokens at -inf
        """q's logits masked as p's are, where the look-ahead stands (at least one token stays)."""
        allowed = self.allowed()[: logits.shape[-1]].to(logits.device)
        if logits.shape[-1] > allowed.shape[0]:  # a draft with more (padding) ids than the target
            allowed = torch.cat([allowed, allowed.new_zeros(logits.shape[-1] - allowed.shape[0])])
        masked = logits.masked_fill(~allowed, float("-inf"))
        # A draft whose own vocabulary (a head's) holds none of the allowed tokens keeps its q.
        return masked if bool(torch.isfinite(masked).any()) else logits

    @timed
    def look_ahead(self, token: int) -> bool:
        """Walk one drafted token (undone by end_look_ahead); False where the grammar refuses it or
        stops after it (nothing to draft past)."""
        if self.matcher.is_stopped() or self.valid_prefix([token]) < 1:
            return False
        self.matcher.consume_token(token)
        self.walked += 1
        return not self.matcher.is_stopped()

    def end_look_ahead(self) -> None:
        self.rollback(self.walked)
        self.walked = 0

    @timed
    def forced(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (may be none)."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())

    @timed
    def masks_along(self, tokens: list[int], parents: tuple[int, ...] | None) -> torch.Tensor:
        """[nodes + 1, vocab] bool: the allowed tokens at the root and after each drafted node,
        for a chain (parents None) or a tree. A node the grammar refuses gets an all-true row:
        the masked p gives the node probability 0, so verification never reaches past it."""
        parents = parents if parents is not None else tuple(range(-1, len(tokens) - 1))
        rows = [self.allowed()]
        paths: list[list[int] | None] = []
        for token, parent in zip(tokens, parents, strict=True):
            path = [] if parent < 0 else paths[parent]
            paths.append(None if path is None else [*path, token])
            walked = paths[-1]
            if walked is None or self.valid_prefix(walked) < len(walked):
                paths[-1] = None
                rows.append(torch.ones(self.vocab_size, dtype=torch.bool))
                continue
            self.matcher.consume_tokens(walked)  # all valid (an end token only where the grammar may end)
            allowed = self.allowed()
            # A grammar that allows nothing after an end token (llguidance allows the end again) must
            # still give the verifier a distribution there; the request ends at the end token anyway.
            rows.append(allowed if allowed.any() else torch.ones(self.vocab_size, dtype=torch.bool))
            self.rollback(len(walked))
        return torch.stack(rows)


def mask_logits(
    logits: torch.Tensor,  # [n, vocab]: a step's rows for every request
    masks: list[tuple[int, torch.Tensor]],  # (first row, allowed [rows, vocab] bool) per constrained request
) -> torch.Tensor:  # [n, vocab], disallowed tokens at -inf
    if not masks:
        return logits
    masked = logits.clone()
    for start, allowed in masks:
        rows = masked[start : start + allowed.shape[0]]
        rows.masked_fill_(~allowed.to(rows.device), float("-inf"))
    return masked
