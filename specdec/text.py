"""The text layer, above the engine: prompts to ids, ids to streamed text, stop strings, and what
a step adds to a request as text (step_chunk: the decoder and the server stream the same chunks).

Text is released only when it can no longer turn out to be part of a stop string: a delta that
ends with the beginning of a stop string is held back until the next tokens show whether the
stop string completes (then the text stops before it) or not (then the held text is released).
So the streamed text is always exactly a prefix of the final text.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.core.drafts import StepOutcome
from specdec.core.engine import Request
from specdec.core.metrics import SpecStats
from specdec.core.sampling import SamplingParams, TokenLogprob
from specdec.drafting.corpus import CORPUS
from specdec.drafting.prediction import PREDICTION
from specdec.stops import StopMatcher


class TokenSource(str, enum.Enum):
    """How an emitted token came about (what `specdec generate --show` colours)."""

    DRAFT = "draft"  # proposed by the drafter, accepted by the target
    BRANCH = "branch"  # an accepted tree token that was not its parent's first (most likely) child
    CACHE = "cache"  # an accepted draft guessed from earlier requests' outputs (a suffix drafter's cache)
    CORPUS = "corpus"  # an accepted draft retrieved from a datastore of code (the corpus drafter, --index)
    PREDICTION = "prediction"  # an accepted draft copied from the request's prediction (predicted outputs)
    RELAXED = "relaxed"  # a draft the exact test rejected, kept by a LOSSY acceptance rule (specdec.core.acceptance)
    CORRECTION = "correction"  # the target's token where it rejected a draft
    BONUS = "bonus"  # the target's extra token after every draft was accepted
    FORCED = "forced"  # the only token the request's grammar allowed, drafted for nothing
    TARGET = "target"  # plain decoding: nothing was drafted this step


def token_sources(outcome: StepOutcome) -> list[TokenSource]:
    """How each emitted token of a step came about."""
    parents, path = outcome.parents, outcome.path
    if outcome.num_drafted == 0:
        return [TokenSource.TARGET]
    if outcome.forced:
        return [TokenSource.FORCED] * outcome.num_accepted + [TokenSource.BONUS]
    if parents is None or path is None:  # a chain
        last = TokenSource.BONUS if outcome.num_accepted == outcome.num_drafted else TokenSource.CORRECTION
        accepted = [TokenSource.DRAFT] * outcome.num_accepted
    else:  # a tree: the bonus comes after a leaf, a correction after a node with children left
        end = int(path[-1]) if outcome.num_accepted else -1
        last = TokenSource.CORRECTION if end in set(parents) else TokenSource.BONUS
        first_children = {parent: parents.index(parent) for parent in set(parents)}
        accepted = [TokenSource.DRAFT if first_children[parents[node]] == node else TokenSource.BRANCH
                    for node in path.tolist()]
    if outcome.drafter in (CORPUS, PREDICTION):
        accepted = [TokenSource(outcome.drafter)] * len(accepted)
    if outcome.from_cache is not None:
        accepted = [TokenSource.CACHE if outcome.from_cache[node] else source
                    for node, source in zip(outcome.accepted_nodes, accepted, strict=True)]
    if outcome.relaxed:
        accepted = [TokenSource.RELAXED if node in outcome.relaxed else source
                    for node, source in zip(outcome.accepted_nodes, accepted, strict=True)]
    return accepted + [last]


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int], model_name: str) -> list[int]:
    """Token ids of a prompt given as text (needs the tokenizer) or as ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError(f"{model_name} has no tokenizer; pass the prompt as token ids")
        return list(tokenizer.encode(prompt))
    return [int(token) for token in prompt]


def with_prediction_ids(sampling: SamplingParams, tokenizer: Any, model_name: str) -> SamplingParams:
    """``sampling`` with a text prediction encoded into the target's token ids, as output text (no
    special tokens: it continues an answer), which the engine and the prediction drafter read;
    ids and no prediction pass through."""
    if not isinstance(sampling.prediction, str):
        return sampling
    if sampling.prediction and tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer; pass the prediction as token ids")
    ids = tuple(tokenizer.encode(sampling.prediction, add_special_tokens=False)) if sampling.prediction else ()
    return dataclasses.replace(sampling, prediction=ids)


# Unicode normalization (NFKC) can turn one character of up to 4 UTF-8 bytes into a single byte of
# a token's spelling (U+1D400 MATHEMATICAL BOLD CAPITAL A -> "A"); a character never becomes less.
NORMALIZED_BYTES = 4


def most_bytes_a_token(tokenizer: Any) -> int | None:
    """The most bytes of text one token can stand for: its longest spelling in UTF-8, times
    NORMALIZED_BYTES (a byte-level or SentencePiece spelling is never shorter than the bytes it
    stands for; a tokenizer that deletes characters, as BERT's text cleaning, is not covered).
    None for a tokenizer without a vocabulary to read. Reading the vocabulary takes tens of ms:
    once per tokenizer (a server: when it starts)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    return max((len(token.encode()) for token in get_vocab()), default=1) * NORMALIZED_BYTES


def fewest_tokens(text: str, most_bytes: int) -> int:
    """A lower bound on the tokens ``text`` encodes to, without encoding it (``most_bytes``: of
    most_bytes_a_token). Why: a prompt far past the context is refused before its whole text is
    tokenized (megabytes take seconds)."""
    return len(text.encode()) // most_bytes


def chat_text(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """A conversation through the tokenizer's chat template, ending with the assistant's turn
    opened. A tokenizer without a template (such as the bundled toy pair's) gets plain
    "role: content" lines and a final "assistant:"."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this model has none")
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of chat_text (the template already holds every special token it wants). A
    message's content is text: where it holds the string of an added token (``<|im_end|>`` typed
    by a user), that string is encoded as the text it is, never as the control token, or a user
    could end their turn and write the system's or the assistant's. The template is then rendered
    around placeholders, its own pieces encoded as usual and each content with special tokens
    split (a conversation without such strings is encoded whole, as always)."""
    markers = [token for token in getattr(tokenizer, "get_added_vocab", dict)() if len(token) > 1]
    if not any(marker in message["content"] for message in messages for marker in markers):
        return list(tokenizer.encode(chat_text(tokenizer, messages), add_special_tokens=False))
    holders = {f"\ue000{index}\ue001": message["content"] for index, message in enumerate(messages)}
    text = chat_text(tokenizer, [{**message, "content": holder}
                                 for holder, message in zip(holders, messages, strict=True)])
    ids: list[int] = []
    for piece in re.split("(\ue000\\d+\ue001)", text):
        if piece in holders:
            ids += tokenizer.encode(holders[piece], add_special_tokens=False, split_special_tokens=True)
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
    return ids


class IncrementalDetokenizer:
    """Text deltas for a growing list of ids, without re-decoding everything each time.
    A delta is held back while it ends in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Any) -> None:
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


class TextStream:
    """Token ids (with a label each, such as how the token came about) in, released text out.

    push() returns whether a stop string completed; release() returns the text that is now
    safe to show, as (text, label) pieces in order."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(stops)  # the text so far against every stop string at once
        self.pieces: list[tuple[str, Any]] = []  # text not yet released, with labels
        self.released = 0  # characters of detokenizer.text released so far
        self.stop_at: int | None = None  # where the final text ends, once a stop string completed

    @property
    def text(self) -> str:
        """The final text so far (cut before a stop string once one completed)."""
        return self.detokenizer.text[: self.stop_at]

    def push(self, token_id: int, label: Any = None) -> bool:
        delta = self.detokenizer.push(token_id)
        self.pieces.append((delta, label))
        # A stop string newly completed ends inside the text this token added (the text only grows).
        if self.stop_at is None:
            self.stop_at = self.stops.feed(delta)
        return self.stop_at is not None

    def release(self, final: bool = False) -> list[tuple[str, Any]]:
        """Text that no later token can retract; everything left when ``final``."""
        text = self.detokenizer.text
        if self.stop_at is not None:
            end = self.stop_at
        elif final:
            end = len(text)
        else:
            end = len(text) - min(self.stops.held, len(text) - self.released)
        out: list[tuple[str, Any]] = []
        budget = max(0, end - self.released)
        while self.pieces and budget > 0:
            piece, label = self.pieces[0]
            taken = piece[:budget]
            out.append((taken, label))
            budget -= len(taken)
            self.released += len(taken)
            if len(taken) < len(piece):
                self.pieces[0] = (piece[len(taken) :], label)
            else:
                self.pieces.pop(0)
        if final or self.stop_at is not None:
            self.pieces.clear()
        # Tokens that added no text still count (an EOS, a partial UTF-8 sequence).
        while self.pieces and not self.pieces[0][0]:
            out.append(self.pieces.pop(0))
        return out


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only (an EOS that ended generation included)
    prompt_ids: list[int]
    finish_reason: str  # "eos", "stop", "max_new_tokens" or "context"
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when SamplingParams.logprobs asked


@dataclass
class StreamChunk:
    """The tokens one step emitted (after stop conditions), and the text now safe to show."""

    token_ids: list[int] = field(default_factory=list)
    sources: list[TokenSource] = field(default_factory=list)  # one per token
    pieces: list[tuple[str, TokenSource]] = field(default_factory=list)  # released text, by source
    result: GenerationResult | None = None  # set on the last chunk only
    logprobs: list[TokenLogprob] | None = None  # one per token, when SamplingParams.logprobs asked

    @property
    def text(self) -> str:
        return "".join(piece for piece, _ in self.pieces)


def step_chunk(request: Request, outcome: StepOutcome, length: int, text: TextStream, started: float) -> StreamChunk:
    """What a step added to ``request`` (whose context had ``length`` tokens before), after stop
    strings (which finish the request); the result on the request's last chunk."""
    chunk = StreamChunk()
    sources = token_sources(outcome)
    for index, token in enumerate(request.tokens[length : request.length].tolist()):
        chunk.token_ids.append(token)
        chunk.sources.append(sources[index])
        if text.push(token, sources[index]):
            request.finish_reason = "stop"
            request.truncate(length + index + 1)
            break
    chunk.pieces = text.release(final=request.finish_reason is not None)
    asked = request.sampling.logprobs is not None
    first = length - len(request.prompt_ids)  # generated tokens before this step's
    if asked:
        chunk.logprobs = request.logprobs[first : first + len(chunk.token_ids)]
    stats = request.stats
    stats.generated_tokens = request.length - len(request.prompt_ids)
    if request.finish_reason is not None:
        stats.total_seconds = time.perf_counter() - started
        chunk.result = GenerationResult(text=text.text, token_ids=request.generated_ids,
                                        prompt_ids=request.prompt_ids, finish_reason=request.finish_reason,
                                        stats=stats,
                                        logprobs=request.logprobs[: len(request.generated_ids)] if asked else None)
    return chunk
