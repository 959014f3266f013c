"""What the front doors (HTTP gateway, gRPC server, CLI) serve: a `Service`.

A service takes token ids and sampling parameters and streams `TokenEvent`s back; it knows the
model's name, tokenizer and context length, can abort a request everywhere, and reports its workers'
load. Two implementations:

- `ClusterService`: the Ray cluster (disaggregated or colocated), through its router.
- `LocalService`: one colocated `Worker` in this process, no Ray: `pdserve serve --local`, and the
  front doors' tests, which then start in a second instead of a Ray cluster's ten.

Errors a caller must tell apart (the front doors map them to status codes): `ValueError` for a
request that can never run (400), `QueueFullError` and `NoCapacityError` for a full cluster (429),
`ServiceUnavailable` while starting or after stopping (503). Anything else is an internal error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.sampling_params import SamplingParams
from cluster.scheduler import QueueFullError
from cluster.tokenizer import Tokenizer
from cluster.worker import TokenEvent, Worker, WorkerLoad

__all__ = ["ClusterService", "LocalService", "NoCapacityError", "QueueFullError", "Service", "ServiceUnavailable",
           "check_prompt", "collect"]


class ServiceUnavailable(RuntimeError):
    """The service is starting, draining or stopped: try again later (HTTP 503, gRPC UNAVAILABLE)."""


class NoCapacityError(RuntimeError):
    """No decode worker could take the request now (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""


class Service(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def ready(self) -> bool:
        """The model is loaded and the workers a request needs are up."""
        ...

    def generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[TokenEvent]:
        """Stream the request's events, the last one `finished`. Raises the errors above."""
        ...

    async def abort(self, request_id: str) -> None:
        """End the request wherever it runs and free its blocks on every worker (no error if unknown)."""
        ...

    async def workers(self) -> list[WorkerLoad]:
        """Each worker's load and KV usage, for `pdserve status` and the metrics."""
        ...


def check_prompt(service: Service, prompt: list[int], params: SamplingParams) -> None:
    """Refuse, before anything runs, a request that cannot fit the context (ValueError -> 400)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if len(prompt) + 1 > service.max_model_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context holds {service.max_model_len}")


class LocalService:
    """A colocated worker in this process: the whole engine behind the same interface, no Ray."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.worker = Worker("local-0", "colocated", engine)
        self._started = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> LocalService:
        return cls(LLMEngine(config))

    @property
    def ready(self) -> bool:
        return self._started and not self.worker.stopped

    async def start(self) -> LocalService:
        await self.worker.start()
        self._started = True
        return self

    async def stop(self) -> None:
        await self.worker.stop()

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[TokenEvent]:
        if not self.ready:
            raise ServiceUnavailable("the engine is not running")
        check_prompt(self, prompt, params)
        async for output in self.worker.generate(request_id, prompt, params):
            yield TokenEvent.of(output, self.worker.worker_id)

    async def abort(self, request_id: str) -> None:
        if self.ready:
            await self.worker.abort(request_id)

    async def workers(self) -> list[WorkerLoad]:
        return [await self.worker.load()] if self.ready else []


class ClusterService:
    """The Ray cluster behind the `Service` interface. Call from one event loop (the server's)."""

    def __init__(self, cluster: Any) -> None:  # a started `cluster.cluster.Cluster`
        self.cluster = cluster
        self.model_name: str = cluster.model_name
        self.max_model_len: int = cluster.max_model_len
        self.tokenizer: Tokenizer = cluster.tokenizer

    @property
    def ready(self) -> bool:
        return self.cluster.router is not None

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
    the errors they handle, so `except QueueFullError` works across the process boundary."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, (ValueError, QueueFullError, NoCapacityError, ServiceUnavailable)):
        return cause
    return error


async def collect(events: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
    """Every event of a stream (tests, the CLI)."""
    return [event async for event in events]

