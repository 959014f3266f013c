"""Which shared state a URL names: this process's own, or Redis behind the resilient wrapper."""

from __future__ import annotations

from cluster.state.in_process import InProcessState
from cluster.state.interface import SharedState


def connect_state(url: str | None) -> SharedState:
    """No URL: this process's own state. A redis:// URL: Redis, with fallbacks while it is away."""
    if not url:
        return InProcessState()
    from cluster.state.redis_state import RedisState  # redis loads only when configured
    from cluster.state.resilient import ResilientState

    return ResilientState(RedisState(url))

