"""The Ray cluster behind the `Service` interface. It holds a started `cluster.ray_cluster.launcher.Cluster`
but imports neither it nor Ray: errors come back through Ray's wrapper and are unwrapped here."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from cluster.common.errors import NoCapacityError, QueueFullError, ServiceUnavailable
from cluster.common.events import TokenEvent
from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.serving.service import check_prompt
from cluster.weights.tokenizer import Tokenizer


class ClusterService:
    """The Ray cluster behind the `Service` interface. Call from one event loop (the server's)."""

    def __init__(self, cluster: Any) -> None:  # a started `cluster.ray_cluster.launcher.Cluster`
        self.cluster = cluster
        self.model_name: str = cluster.model_name
        self.max_model_len: int = cluster.max_model_len
        self.tokenizer: Tokenizer = cluster.tokenizer

    @property
    def ready(self) -> bool:
        """Started, no worker failed its warm-up, and at least one router replica answers."""
        routers_up = len(self.cluster.routers) - len(self.cluster.routers_down)
        return self.cluster.router is not None and not self.cluster.failures and routers_up > 0

    @property
    def problem(self) -> str:
        problems = [f"{worker_id}: {failure}" for worker_id, failure in self.cluster.failures.items()]
        return "; ".join(problems + list(self.cluster.routers_down.values()))

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[TokenEvent]:
        if not self.ready:
            raise ServiceUnavailable("the cluster is not running")
        check_prompt(self, prompt, params)
        try:
            async for event in self.cluster.generate(prompt, params, request_id):
                yield event
        except Exception as error:
            raise _cause_of(error) from None

    async def abort(self, request_id: str) -> None:
        if self.ready:
            await self.cluster.abort(request_id)

    async def workers(self) -> list[WorkerLoad]:
        return await self.cluster.workers() if self.ready else []


def _cause_of(error: Exception) -> Exception:
    """Ray wraps an actor's exception in RayTaskError: give callers the original, when it is one of
    the errors they handle, so `except QueueFullError` works across the process boundary. (A
    request's own errors come back unwrapped on the router's channel: `cluster.ray_cluster.channels`.)"""
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, (ValueError, QueueFullError, NoCapacityError, ServiceUnavailable)):
        return cause
    return error

