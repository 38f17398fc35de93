"""The OpenAI wire format: request bodies, their validation into SamplingParams, response objects.

Errors are ``ApiError``s that the app turns into OpenAI-style bodies:
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.constraint import Constraint, ConstraintError
from specdec.core.acceptance import EXACT, canonical_acceptance
from specdec.core.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob
from specdec.decoder import GenerationResult

MAX_CHOICES = 16  # the most choices (n) one request may ask for
# Stop strings a request may give (OpenAI's API takes 4); matching costs the same per token
# however many there are (stops.py), but each one is held in memory per running request.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARACTERS = 4096
# Our finish reasons in OpenAI's words.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "max_new_tokens": "length", "context": "length"}
MAX_TEMPERATURE = 2.0  # OpenAI's range: 0..2
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit seed, as torch's generators take it

# Which OpenAI endpoint a response answers: /v1/completions or /v1/chat/completions.
ResponseKind = Literal["completion", "chat"]


def check_text(text: str, param: str) -> str:
    """``text`` if it can be encoded (UTF-8); a lone surrogate gets a 400 naming where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(400, f"{param} is not valid Unicode text: a lone surrogate at character {error.start}",
                       param) from None
    return text


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def content_text(content: str | list[dict[str, Any]], where: str) -> str:
    """OpenAI's content, a string or text parts (joined), as text; a 400 naming ``where`` for parts
    that are not text (images) and for text a tokenizer cannot take (a lone surrogate)."""
    if isinstance(content, list):
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in content):
            raise ApiError(400, f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                "supported", where)
        content = "".join(part["text"] for part in content)
    return check_text(content, where)


class Prediction(BaseModel):
    """OpenAI's predicted output: the text the answer is expected to be (an edited file as it is
    now). It drafts (specdec.drafting.prediction); the answer is the target's whatever it says."""

    type: Literal["content"]
    content: str | list[dict[str, Any]]


class SamplingFields(BaseModel):
    """What completions and chat share. top_k, min_p and sampling_rule are extensions (as vLLM's)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    sampling_rule: str | None = None  # "coupled" | "rejection"; default: coupled with a seed (docs/sampling.md)
    # LOSSY opt-in (docs/acceptance.md): "exact" | "lossy" | "topk:k=3,delta=0.5" | ...; default: the server's
    acceptance: str | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1  # choices, from one prefill (the cache row forked); with a seed s, choice i samples with seed s + i
    prediction: Prediction | None = None  # OpenAI's predicted outputs: drafts, never changes the answer
    # Structured output (docs/structured.md): OpenAI's response_format, and vLLM's extensions
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # OpenAI parameters that would change the output and are not supported: refused, not ignored
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    tools: list[Any] | None = None

    def refuse_unsupported(self) -> None:
        """An ApiError (400) naming the first parameter set to something this server does not do."""
        unsupported = [("presence_penalty", self.presence_penalty not in (None, 0)),
                       ("frequency_penalty", self.frequency_penalty not in (None, 0)),
                       ("logit_bias", bool(self.logit_bias)), ("best_of", self.best_of not in (None, 1, self.n)),
                       ("echo", bool(self.echo)), ("suffix", bool(self.suffix)), ("tools", bool(self.tools))]
        for name, asked in unsupported:
            if asked:
                raise ApiError(400, f"{name} is not supported by this server (it would change the output)", name)

    def asked_constraint(self) -> tuple[str, Any] | None:
        """(field, value) of the structured output asked for; None: free text; a 400 for several."""
        fmt = self.response_format
        asked = [(name, value) for name, value in (
            ("response_format", None if fmt is None or fmt.type == "text" else fmt), ("guided_json", self.guided_json),
            ("guided_regex", self.guided_regex), ("guided_grammar", self.guided_grammar)) if value is not None]
        if len(asked) > 1:
            raise ApiError(400, f"give one of {', '.join(name for name, _ in asked)}, not several", asked[1][0])
        return asked[0] if asked else None

    def constraint(self) -> Constraint | None:
        """What the output must match; ApiError (400) for what is refused before compiling (a schema
        nested too deep, not JSON). The grammar engine checks the rest when it compiles it for the
        tokenizer, off the serving loop (serving/admission.py)."""
        asked = self.asked_constraint()
        if asked is None:
            return None
        name, value = asked
        try:
            if isinstance(value, ResponseFormat):
                if value.type == "json_object":
                    return Constraint.json_object()
                if value.json_schema is None or value.json_schema.schema_ is None:
                    raise ApiError(400, "response_format json_schema needs json_schema.schema", name)
                return Constraint.json_schema(value.json_schema.schema_)
            if isinstance(value, str):
                check_text(value, name)  # the grammar engine takes UTF-8 text only
            if name == "guided_json":
                return Constraint.json_schema(value)
            return Constraint.regex(str(value)) if name == "guided_regex" else Constraint.grammar(str(value))
        except ConstraintError as error:
            raise ApiError(400, str(error), name) from None

    def requested_logprobs(self) -> int | None:
        """How many alternatives each token's log-probability comes with (None: no log-probabilities)."""
        return None

    def sampling(self, max_tokens: int | None, default_max_tokens: int, limit: int,
                 default_acceptance: str = EXACT) -> SamplingParams:
        """SamplingParams, or an ApiError naming the offending field."""
        self.refuse_unsupported()
        try:
            acceptance = canonical_acceptance(default_acceptance if self.acceptance is None else self.acceptance)
        except ValueError as error:
            raise ApiError(400, str(error), "acceptance") from None
        temperature = 1.0 if self.temperature is None else self.temperature
        if not 0.0 <= temperature <= MAX_TEMPERATURE:
            raise ApiError(400, f"temperature must be in [0, {MAX_TEMPERATURE}], got {temperature}", "temperature")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ApiError(400, f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        if max_tokens > limit:
            raise ApiError(400, f"max_tokens is {max_tokens}, but this server allows at most {limit}", "max_tokens")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ApiError(400, f"seed must be a 64-bit integer, in [-2^63, 2^63 - 1]; got {self.seed}", "seed")
        stop = tuple(check_text(text, "stop") for text in ((self.stop,) if isinstance(self.stop, str) else
                                                          (self.stop or ())))
        if len(stop) > MAX_STOP_STRINGS or sum(map(len, stop)) > MAX_STOP_CHARACTERS:
            raise ApiError(400, f"stop has {len(stop)} strings of {sum(map(len, stop))} characters in all; this "
                                f"server takes at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARACTERS} in all",
                           "stop")
        try:
            return SamplingParams(temperature=temperature, top_k=self.top_k or 0,
                                  top_p=1.0 if self.top_p is None else self.top_p,
                                  min_p=self.min_p or 0.0, seed=self.seed, sampling_rule=self.sampling_rule,
                                  max_new_tokens=max_tokens, stop=stop, constraint=self.constraint(),
                                  logprobs=self.requested_logprobs(), acceptance=acceptance,
                                  prediction=None if self.prediction is None else
                                  content_text(self.prediction.content, "prediction.content"))
        except ValueError as error:
            raise ApiError(400, str(error)) from error


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # the top alternatives per token (OpenAI's completions allow 0-5)

    def requested_logprobs(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise ApiError(400, f"logprobs must be in [0, 5], got {self.logprobs}", "logprobs")
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request, got {len(prompt)}", "prompt")
            prompt = prompt[0]  # a list of one prompt is that prompt (a string or a list of ids)
        if not prompt:
            raise ApiError(400, "prompt is empty", "prompt")
        return check_text(prompt, "prompt") if isinstance(prompt, str) else prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = ""

    def as_text(self, index: int) -> dict[str, str]:
        """{"role", "content"} with the content as text (OpenAI's text parts joined); a 400 for what
        is not text (null, image parts, a lone surrogate)."""
        where = f"messages[{index}].content"
        if self.content is None:
            raise ApiError(400, f"{where} is null; give the message's text", where)
        return {"role": self.role, "content": content_text(self.content, where)}


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                           "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, prediction_tokens: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """OpenAI's usage object; ``prediction_tokens``: (accepted, rejected) tokens drafted from the
    request's prediction, as its completion_tokens_details report them."""
    accepted, rejected = prediction_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def speculation_summary(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """specdec's own extension of a response: what speculation did for its choices, together."""
    drafted, accepted = sum(r.stats.drafted for r in results), sum(r.stats.accepted for r in results)
    forwards = sum(r.stats.target_forwards for r in results)
    tokens = sum(r.stats.generated_tokens for r in results)
    return {"drafted": drafted, "accepted": accepted, "target_forwards": forwards,
            "tokens_per_forward": round(tokens / forwards, 3) if forwards else 0.0, **acceptance_summary(results)}


def acceptance_summary(results: Sequence[GenerationResult]) -> dict[str, Any]:
    """How the choices were verified: "exact", or a LOSSY rule and the drafts only it accepted."""
    acceptance = results[0].stats.acceptance if results else EXACT  # one request's choices share it
    return {"acceptance": acceptance, "lossy": acceptance != EXACT,
            "relaxed_accepted": sum(r.stats.relaxed_accepted for r in results)}


def logprobs_object(kind: ResponseKind, entries: Sequence[TokenLogprob], tokenizer: Any,
                    offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs of a choice (or of a streamed chunk, whose text starts at ``offset``):
    completions' tokens / token_logprobs / top_logprobs / text_offset, chat's content list."""
    def text(token: int) -> str:
        return tokenizer.decode([token])

    if kind == "completion":
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(text(entry.token))
        return {"tokens": [text(entry.token) for entry in entries],
                "token_logprobs": [entry.logprob for entry in entries],
                "top_logprobs": [{text(token): value for token, value in entry.top} for entry in entries],
                "text_offset": offsets}

    def item(token: int, value: float) -> dict[str, Any]:
        return {"token": text(token), "logprob": value, "bytes": list(text(token).encode())}

    return {"content": [{**item(entry.token, entry.logprob), "top_logprobs": [item(*pair) for pair in entry.top]}
                        for entry in entries]}


def completion_object(kind: ResponseKind, request_id: str, model: str, text: str,
                      finish_reason: str | None, created: int | None = None, chunk: bool = False,
                      first: bool = False, index: int = 0, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A completion (or a streamed chunk of one): text_completion, chat.completion(.chunk)."""
    created = created or int(time.time())
    if kind == "completion":
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        name = "text_completion"
    elif chunk:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        name = "chat.completion.chunk"
    else:
        choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        name = "chat.completion"
    return {"id": request_id, "object": name, "created": created, "model": model, "choices": [choice]}
