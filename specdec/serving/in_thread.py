"""A server in a background thread of this process, on a free port: for tests, benchmarks and
bench-serve's servers side by side."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from specdec.serving.server import DEFAULT_SHUTDOWN_TIMEOUT

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``app`` on a free port in a background thread while the block runs; yields the base
    URL (http://HOST:PORT). For tests and benchmarks."""
    from specdec.serving.shutdown import graceful_server

    with running_in_thread(graceful_server(app, host, 0, DEFAULT_SHUTDOWN_TIMEOUT)) as url:
        yield url


@contextlib.contextmanager
def running_in_thread(server: uvicorn.Server) -> Iterator[str]:
    """Run a uvicorn ``server`` (port 0: a free one) in a background thread while the block runs;
    yields its base URL."""
    thread = threading.Thread(target=server.run, name="specdec-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{server.config.host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
