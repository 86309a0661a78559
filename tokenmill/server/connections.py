"""Limits on connections that uvicorn does not set itself: how long a client may take to send a
request's headers, and how many connections may be open at once.

uvicorn closes a connection that stays idle between requests (its keep-alive timeout), but one
that trickles a request's headers a byte at a time, or opens and says nothing, stays open for as
long as the client likes. ``GuardedH11Protocol`` starts a timer when a connection opens and when
a response completes, and closes the connection if the next request's headers have not all
arrived when it fires. A connection beyond ``max_connections`` is answered 503 and closed at
once. (The body has its own limit in the routes: see ``server.errors.read_body``.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
         b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s")
_BUSY_BODY = (b'{"error":{"message":"too many open connections; retry later",'
              b'"type":"server_error","param":null,"code":"too_many_connections"}}')


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-header timeout and a cap on open connections.

    ``header_timeout`` and ``max_connections`` are class attributes: uvicorn builds one
    protocol object per connection from the class, so ``configured`` makes a subclass that
    carries the server's settings."""

    header_timeout: float = 10.0
    max_connections: int = 1024

    @classmethod
    def configured(cls, header_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
        return type("GuardedH11Protocol", (cls,), {"header_timeout": header_timeout,
                                                   "max_connections": max_connections})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.write(_BUSY % (len(_BUSY_BODY), _BUSY_BODY))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # The headers are in once h11 has moved past waiting for a request line and headers.
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection that did not send its request headers "
                             "within %.0f s", self.header_timeout)
            self.transport.close()
