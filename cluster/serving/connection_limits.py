"""What one connection may hold at either front door, and for how long (docs/security.md).

Both doors take the same `ConnectionLimits`: past `max_connections` a door refuses (HTTP: 503 to
every new request; gRPC: new connections closed); a request must arrive whole within
`request_read_timeout_s` (HTTP headers and body; a gRPC connection's TLS and HTTP/2 handshake); a
client that reads nothing of its stream for `stream_write_timeout_s` is cut off and its request
aborted on every worker. This module is light: no server library is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
DEFAULT_STREAM_WRITE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 4096
    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S
    # A socket's send buffer: the kernel grows it to megabytes for a client that does not read, and a
    # stalled stream would never be noticed; Linux doubles the value for its bookkeeping.
    send_buffer_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        if self.request_read_timeout_s <= 0 or self.stream_write_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.send_buffer_bytes < 4096:
            raise ValueError("send_buffer_bytes must be at least 4096")
