"""What a request passes before it joins the batch, beyond its fields' own checks: its constraint
compiled for the target's tokenizer, off the serving loop and within a size and a time limit; and
what a client is told when its request fails later, while it generates.

Compiling a grammar is the grammar engine's work on the whole grammar (seconds for a large one; it
releases the GIL): on a worker thread it delays only its own request, where on the scheduler
thread it paused every stream (a 1.3 MB grammar: 15 s). The engine's refusals, including those
that only come once tokens flow (GrammarCompiler.matcher's probe), are then a 400 for that request
before it takes a cache row, never an error in the middle of a batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from specdec.constraint import Constraint, ConstraintError
from specdec.core.request import NOT_ISOLATED
from specdec.grammar import TokenMatcher, compiler_for
from specdec.serving.protocol import ApiError

log = logging.getLogger("specdec.serving")


# The largest repetition a regex may ask for, nested bounds multiplied ("(a{100}){100}": 10,000),
# and so a JSON schema's patterns and a grammar's bounds (constraint_repetition). The grammar engine
# expands a bounded repetition as it goes, so a{1000000} passes compilation and the forced-token
# walk, then fails once tokens flow, in the middle of a batch.
MAX_REPETITION = 10_000


def largest_repetition(pattern: str) -> int | None:
    """The largest product of nested repetition bounds in ``pattern`` (an unbounded one counts
    its lower bound), or None where Python's regex parser cannot read it (a syntax only the
    grammar engine's own dialect has: the engine judges it alone)."""
    import re._constants as constants
    import re._parser as parser

    try:
        parsed = parser.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None

    def largest(items: Any) -> int:
        found = 1
        for op, value in items:
            if op in (constants.MAX_REPEAT, constants.MIN_REPEAT, getattr(constants, "POSSESSIVE_REPEAT", None)):
                low, high, inner = value
                found = max(found, max(1, low if high == constants.MAXREPEAT else high) * largest(inner))
            else:
                for part in value if isinstance(value, (tuple, list)) else ():
                    if isinstance(part, parser.SubPattern):
                        found = max(found, largest(part))
                    elif isinstance(part, list):  # a branch's alternatives
                        found = max([found, *(largest(branch) for branch in part
                                              if isinstance(branch, parser.SubPattern))])
        return found

    return largest(parsed)


# A grammar's bounded repetitions: Lark's "item ~ n" and "item ~ m..n", GBNF's "item{m}",
# "item{m,}" and "item{m,n}"; and its regex literals, /.../ (Lark) as a whole.
GRAMMAR_BOUNDS = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?|\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
GRAMMAR_REGEX_LITERALS = re.compile(r"/((?:[^/\\\n]|\\.)+)/")


def schema_patterns(schema: Any) -> list[str]:
    """Every regex a JSON schema holds: "pattern" values and "patternProperties" keys, at any
    depth (walked without recursion: a schema may nest deeper than Python's stack)."""
    found, stack = [], [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("pattern"), str):
                found.append(item["pattern"])
            if isinstance(item.get("patternProperties"), dict):
                found.extend(key for key in item["patternProperties"] if isinstance(key, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def constraint_repetition(constraint: Constraint) -> int | None:
    """The largest repetition a constraint asks for, where it can be read here: a regex's
    (largest_repetition), the largest of a JSON schema's patterns, or of a grammar's regex
    literals and bounded repetitions (each bound alone: rules that repeat one another are the
    grammar engine's to judge). None where nothing is readable."""
    if constraint.kind == "regex":
        return largest_repetition(constraint.source)
    if constraint.kind == "json_schema":
        try:
            patterns = schema_patterns(json.loads(constraint.source))
        except (ValueError, RecursionError):
            return None  # the schema's own checks say what is wrong with it
        found = [largest_repetition(pattern) for pattern in patterns]
    elif constraint.kind == "grammar":
        text = constraint.source
        found = [largest_repetition(literal) for literal in GRAMMAR_REGEX_LITERALS.findall(text)]
        found += [max(int(number) for number in match if number) for match in GRAMMAR_BOUNDS.findall(text)]
    else:
        return None
    readable = [value for value in found if value is not None]
    return max(readable) if readable else None


class ConstraintCompiler:
    """Compiles requests' constraints for ``target`` on ``workers`` threads. A compile past
    ``seconds`` answers 400 at once; its thread runs on to the end (the engine cannot be stopped
    midway), which the size limit ``max_bytes`` keeps short."""

    def __init__(self, target: Any, max_bytes: int, seconds: float, workers: int = 2) -> None:
        self.target, self.max_bytes, self.seconds = target, max_bytes, seconds
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="specdec-grammar")

    async def matchers(self, constraint: Constraint | None, param: str | None, count: int) -> list[TokenMatcher | None]:
        """``count`` matchers at the start of ``constraint`` (one per choice), or an ApiError (400)
        naming ``param``; [None] * count for free text."""
        if constraint is None:
            return [None] * count
        size = len(constraint.source.encode("utf-8"))
        if size > self.max_bytes:
            raise ApiError(400, f"{param} is {size} bytes; this server compiles at most {self.max_bytes} "
                                "(--max-grammar-bytes)", param, code="grammar_too_large")
        repetition = constraint_repetition(constraint)
        if repetition is not None and repetition > MAX_REPETITION:
            raise ApiError(400, f"{param} repeats up to {repetition} times (nested bounds multiplied); this server "
                                f"takes at most {MAX_REPETITION}", param, code="grammar_too_complex")
        work = asyncio.get_running_loop().run_in_executor(self.pool, self.compile, constraint)
        try:
            matcher = await asyncio.wait_for(work, self.seconds)
        except asyncio.TimeoutError:
            raise ApiError(400, f"{param} took over {self.seconds:g} s to compile, this server's limit "
                                "(--grammar-timeout); simplify it", param, code="grammar_too_complex") from None
        except ConstraintError as error:
            raise ApiError(400, str(error), param) from None
        return [matcher, *(matcher.copy() for _ in range(count - 1))]

    def compile(self, constraint: Constraint) -> TokenMatcher:
        """On a worker thread: the matcher, or a ConstraintError for anything the engine does with
        this grammar (a panic of its Rust code included: the grammar caused it, and its text, a
        backtrace, is no message for a client)."""
        try:
            return compiler_for(self.target).matcher(constraint)
        except (ConstraintError, *NOT_ISOLATED):
            raise
        except BaseException as error:  # noqa: BLE001 - see above
            log.warning("the grammar engine failed on a %s constraint: %r", constraint.kind, error)
            raise ConstraintError(f"{constraint.describe()}: the grammar engine failed on it; simplify it") from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class ShuttingDown(RuntimeError):
    """The server stopped a request it had no time left to finish (specdec serve's shutdown)."""


def ended_by(error: BaseException) -> ApiError:
    """The API error of a request that ``error`` ended while it generated: a client's grammar that
    the grammar engine stopped on is the client's to fix (400), a shutdown is the server's
    unavailability (503), anything else an internal error (500)."""
    if isinstance(error, ConstraintError):
        return ApiError(400, public_message(error), kind="invalid_request_error", code="grammar_failed")
    if isinstance(error, ShuttingDown):
        return ApiError(503, str(error), kind="server_error", code="server_shutting_down")
    return ApiError(500, public_message(error), kind="server_error", code="generation_failed")


def public_message(error: BaseException) -> str:
    """What a client is told of the error that ended its request while it generated: one line.
    Our own refusals (a ConstraintError: the grammar engine stopped on this grammar) in their
    words; anything else as an internal error (its text, even its type's name, may be engine state,
    a backtrace, a Rust panic's), the details in the server's log (Scheduler.fail)."""
    if isinstance(error, ConstraintError):
        return f"generation stopped: {str(error).splitlines()[0] if str(error) else 'the grammar refused'}"
    return "generation failed for this request (an internal error); the server's log has the details"
