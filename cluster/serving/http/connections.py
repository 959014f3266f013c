"""What one HTTP connection may hold: a deadline for receiving each request, and a bounded send buffer.

uvicorn times out idle keep-alive connections, but not a request that arrives slowly: a client
sending its headers (or body) a byte every few seconds holds a connection, and its memory, for as
long as it likes (slowloris). `deadline_protocol` gives uvicorn's h11 protocol a deadline: a
connection must deliver each whole request (headers and body) within `seconds` of being opened or
of the request's first byte, or it is closed (an idle connection between requests is closed by
uvicorn's keep-alive timeout).

The kernel grows a socket's send buffer to megabytes when a client does not read, so without a
bound a stalled stream's writes never block and a slow reader is never noticed; `bound_send_buffer`
caps it on the listening socket (accepted connections inherit it).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from cluster.serving.connection_limits import DEFAULT_REQUEST_READ_TIMEOUT_S


class _DeadlineH11Protocol(H11Protocol):
    request_read_timeout_s = DEFAULT_REQUEST_READ_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None
    _between_requests = False  # a response ended and no byte of the next request came yet

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between_requests:  # the next request starts: its own deadline (idle is keep-alive's)
            self._between_requests = False
            self._arm()
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._between_requests = True
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._armed_cycle = self.cycle  # a new request replaces the cycle
        self._deadline = self.loop.call_later(self.request_read_timeout_s, self._expire)

    def _expire(self) -> None:
        """No new request, or one whose body has not all arrived: close the connection."""
        started = self.cycle is not self._armed_cycle
        if self._between_requests or (started and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)):
            return
        if not self.transport.is_closing():
            self.logger.info("closing a connection from %s that sent no whole request in %.0f s",
                             self.client, self.request_read_timeout_s)
            self.transport.close()


def deadline_protocol(seconds: float) -> type[Any]:
    """uvicorn's h11 protocol with a deadline of `seconds` for each request to arrive whole."""
    return type("DeadlineH11Protocol", (_DeadlineH11Protocol,), {"request_read_timeout_s": seconds})


def bound_send_buffer(listener: socket.socket, nbytes: int) -> None:
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
