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
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from specdec.constraint import Constraint, ConstraintError
from specdec.grammar import TokenMatcher, compiler_for
from specdec.request import NOT_ISOLATED
from specdec.serving.protocol import ApiError

log = logging.getLogger("specdec.serving")


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


def public_message(error: BaseException) -> str:
    """What a client is told of the error that ended its request while it generated: one line.
    Our own refusals (a ConstraintError: the grammar engine stopped on this grammar) in their
    words; anything else as an internal error (its text, even its type's name, may be engine state,
    a backtrace, a Rust panic's), the details in the server's log (Scheduler.fail)."""
    if isinstance(error, ConstraintError):
        return f"generation stopped: {str(error).splitlines()[0] if str(error) else 'the grammar refused'}"
    return "generation failed for this request (an internal error); the server's log has the details"
