"""A `Service` that times every request passing through it: both front doors serve through one, so
`/metrics` counts HTTP and gRPC requests alike (`cluster.observability.metrics.RequestMetrics`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from cluster.common.events import TokenEvent
from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.observability.metrics import RequestMetrics
from cluster.serving.service import Service


class MeteredService:
    """A `Service` that times every request passing through it (see `RequestMetrics`)."""

    def __init__(self, service: Service, metrics: RequestMetrics) -> None:
        self.inner, self.metrics = service, metrics

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def ready(self) -> bool:
        return self.inner.ready

    @property
    def problem(self) -> str:
        return self.inner.problem

    def generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[TokenEvent]:
        return self.metrics.observe(self.inner.generate(prompt, params, request_id), len(prompt))

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def workers(self) -> list[WorkerLoad]:
        return await self.inner.workers()

