"""Live gateways for the tests: real engines (`LocalService`) behind uvicorn on free ports.

The servers and engines live on an event loop in a background thread, so that tests can call them
with blocking clients (the sync openai client, httpx) from the test's own thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from fastapi import FastAPI

from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.serving.http.gateway import HttpServer, build_app
from cluster.serving.local_service import LocalService
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway-test-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class LiveGateway:
    service: LocalService
    app: FastAPI
    server: HttpServer

    @property
    def url(self) -> str:
        return self.server.url


class Gateways:
    """Starts services and gateways on one loop thread; stops them all at the end."""

    def __init__(self) -> None:
        self.loop = LoopThread()
        self.servers: list[HttpServer] = []
        self.services: list[LocalService] = []

    def start_service(self, config: EngineConfig, *, start: bool = True) -> LocalService:
        service = LocalService.from_config(config)
        if start:
            self.loop.run(service.start())
            self.services.append(service)
        return service

    def serve(self, service: LocalService, server_options: dict[str, Any] | None = None,
              **app_options: Any) -> LiveGateway:
        app = build_app(service, **app_options)
        server = HttpServer(app, "127.0.0.1", 0, graceful_shutdown_s=1, **(server_options or {}))
        self.loop.run(server.start())
        self.servers.append(server)
        return LiveGateway(service, app, server)

    def close(self) -> None:
        for server in self.servers:
            self.loop.run(server.stop())
        for service in self.services:
            self.loop.run(service.stop())
        self.loop.close()


def tiny_config(path: Path, **scheduler: Any) -> EngineConfig:
    # 128 blocks of 4 tokens: a 512-token context (the checkpoint's limit).
    return EngineConfig(model=fp32_model(path), cache=CacheConfig(block_size=4, num_blocks=128),
                        scheduler=SchedulerConfig(**scheduler))


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll `condition` until true; generous timeouts keep the tests about behaviour, not speed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


class StepCounter:
    """Paces an engine's steps and counts them (read from other threads: a plain int is enough)."""

    def __init__(self, engine: LLMEngine, pause_s: float) -> None:
        self.count = 0
        self.step, self.pause_s = engine.step, pause_s

    def __call__(self) -> Any:
        time.sleep(self.pause_s)
        self.count += 1
        return self.step()


def paced(service: LocalService, pause_s: float = 0.005) -> StepCounter:
    """Pause before each of the service's engine steps, as a larger model's steps would take, so a
    test can be about the order of events rather than wall-clock time; the steps are counted. For a
    service of the test's own: it stays paced."""
    counter = StepCounter(service.engine, pause_s)
    service.engine.step = counter  # type: ignore[method-assign]
    return counter


def engine_idle(service: LocalService) -> bool:
    engine = service.engine
    pool = engine.kv_cache.pool
    return not engine.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks


@pytest.fixture(scope="module")
def gateways() -> Iterator[Gateways]:
    gateways = Gateways()
    yield gateways
    gateways.close()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny(gateways: Gateways, tiny_checkpoint: Path) -> LiveGateway:
    """The tiny random model behind an open gateway."""
    return gateways.serve(gateways.start_service(tiny_config(tiny_checkpoint)))


@pytest.fixture(scope="module")
def default_gateway(gateways: Gateways) -> LiveGateway:
    """The default model (SmolLM2-135M-Instruct) behind an open gateway."""
    config = EngineConfig(model=fp32_model(), cache=CacheConfig(kv_cache_memory_gb=0.25))
    return gateways.serve(gateways.start_service(config))
