"""Which shared state a URL names: this process's own, or Redis behind the resilient wrapper."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from cluster.state.in_process import InProcessState
from cluster.state.interface import SharedState

REDACTED = "***"


def connect_state(url: str | None) -> SharedState:
    """No URL: this process's own state. A redis:// URL: Redis, with fallbacks while it is away."""
    if not url:
        return InProcessState()
    from cluster.state.redis_state import RedisState  # redis loads only when configured
    from cluster.state.resilient import ResilientState

    return ResilientState(RedisState(url))


def redacted_url(url: str) -> str:
    """The URL as logs and error messages may show it: a password (`redis://:secret@host:6379/0`,
    `redis://user:secret@host`, or `?password=secret`) becomes `***`; everything else stays."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL we can take apart (e.g. a bad port): show nothing of it
        return "<a URL that does not parse>"
    netloc = parts.netloc
    if password is not None:
        credentials, _, host = netloc.rpartition("@")
        user = credentials.partition(":")[0]
        netloc = f"{user}:{REDACTED}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(key.lower() == "password" for key, _ in pairs):
            query = urlencode([(key, REDACTED if key.lower() == "password" else value) for key, value in pairs],
                              safe="*")
    return urlunsplit(parts._replace(netloc=netloc, query=query))
