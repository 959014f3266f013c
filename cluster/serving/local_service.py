"""One colocated worker in this process behind the `Service` interface: `pdserve serve --local`, and
the front doors' tests (a second to start, against a Ray cluster's ten)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from cluster.common.errors import ServiceUnavailable
from cluster.common.events import TokenEvent
from cluster.common.loads import WorkerLoad
from cluster.common.roles import Role
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.observability import tracing
from cluster.serving.service import check_prompt
from cluster.worker.own_thread import in_own_thread
from cluster.worker.worker import Worker, event_of


class LocalService:
    """A colocated worker in this process: the whole engine behind the same interface, no Ray."""

    def __init__(self, engine: LLMEngine, engine_cpus: frozenset[int] | None = None) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.worker = Worker("local-0", Role.COLOCATED, engine, engine_cpus=engine_cpus)
        self._started = False

    @classmethod
    def from_config(cls, config: EngineConfig, engine_cpus: frozenset[int] | None = None) -> LocalService:
        """`engine_cpus`: the cores its engine thread computes on (`cluster.worker.cpu_binding`)."""
        # Loaded on a thread that ends: its OpenMP team must not outlive it (`cluster.worker.own_thread`).
        return cls(in_own_thread(lambda: LLMEngine(config)), engine_cpus)

    @property
    def ready(self) -> bool:
        return self._started and not self.worker.stopped and not self.worker.failure

    @property
    def problem(self) -> str:
        return f"{self.worker.worker_id}: {self.worker.failure}" if self.worker.failure else ""

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
        async for output in self.worker.generate(request_id, prompt, params, tracing.current_traceparent()):
            yield event_of(output, self.worker.worker_id)

    async def abort(self, request_id: str) -> None:
        if self.ready:
            await self.worker.abort(request_id)

    async def workers(self) -> list[WorkerLoad]:
        return [await self.worker.load()] if self.ready else []

