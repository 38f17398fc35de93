"""Shutting down within a bound: on SIGTERM (or Ctrl-C) the server stops accepting connections,
lets the requests it holds run for a grace period, then ends those still running with an error
(a final error event for a stream, a 503 body otherwise) and exits. Why: uvicorn alone waits for
every generation to finish (8 streams of 1,024 tokens: 58 s), past a supervisor's grace period
(Kubernetes: 30 s), which then kills the process mid-stream with no word to the clients."""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

import uvicorn

from specdec.serving.admission import ShuttingDown

if TYPE_CHECKING:
    from fastapi import FastAPI

    from specdec.serving.scheduler import Scheduler

# uvicorn's own limit, past ours: the connections still open then (none should be) are cut.
BACKSTOP_SECONDS = 5


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float) -> None:
        super().__init__(config)
        self.scheduler, self.grace = scheduler, grace
        self.deadline: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.deadline is None:  # the first signal: the grace period starts
            error = ShuttingDown(f"the server is shutting down; this request ran past the {self.grace:g} s it "
                                 "was given to finish (--shutdown-timeout)")
            self.deadline = threading.Timer(self.grace, self.scheduler.abort, args=(error,))
            self.deadline.daemon = True
            self.deadline.start()
        super().handle_exit(sig, frame)


def graceful_server(app: FastAPI, host: str, port: int, grace: float) -> GracefulServer:
    """A uvicorn server for ``app`` (built by build_app: its scheduler is app.state.scheduler)
    that shuts down within about ``grace`` seconds."""
    from specdec.serving.connections import DEFAULT_READ_TIMEOUT, timed_protocol

    read_timeout = getattr(app.state, "read_timeout", DEFAULT_READ_TIMEOUT)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=timed_protocol(read_timeout),
                            timeout_graceful_shutdown=math.ceil(grace + BACKSTOP_SECONDS))
    return GracefulServer(config, app.state.scheduler, grace)
