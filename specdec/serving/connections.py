"""The server's connections: deadlines on slow clients (a connection that has not finished sending
a request's headers within the read timeout is closed: uvicorn alone waits forever, and 400
connections dribbling their headers stayed open; the body's deadline is app.RequestBody's, a 408),
and whether a host is this machine's own (serving elsewhere without an API key is warned of)."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

DEFAULT_READ_TIMEOUT = 30.0  # seconds for a request's headers, then for its body


def timed_protocol(read_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools where installed, else h11, as its "auto" picks) with a
    deadline for each request's headers: armed when the connection opens and after each response,
    met when the next request's headers are complete (uvicorn then starts a new request cycle)."""
    base: type[asyncio.Protocol]
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol

    class HeaderDeadline(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()

        def _arm_header_deadline(self) -> None:
            cycle = self.cycle  # a request whose headers complete replaces it

            def expire() -> None:
                if self.cycle is cycle and not self.transport.is_closing():
                    self.transport.close()

            self.loop.call_later(read_timeout, expire)

    return HeaderDeadline


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
