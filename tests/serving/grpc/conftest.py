"""Fixtures of the gRPC tests: servers run on an event loop in a background thread (as beside an
HTTP server), so blocking clients can call them from the test's thread; async clients run on
that same loop through `ServerLoop.run`.

One tiny random-weight model serves every test; tests that need another engine (a small waiting
queue, a service not started yet) build their own from `tiny_config`, which loads in milliseconds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cluster.client import Client
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.serving.grpc.server import GrpcServer
from cluster.serving.local_service import LocalService
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

T = TypeVar("T")
# Generous: a slow machine must not fail a test that only waits for a condition.
WAIT_S = 20.0


class ServerLoop:
    """An asyncio loop on its own thread; `run` executes a coroutine there and returns its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-loop", daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def start_service(self, config: EngineConfig) -> LocalService:
        return self.run(LocalService.from_config(config).start())

    def start_server(self, service: LocalService, **options: Any) -> GrpcServer:
        server = GrpcServer(service, "127.0.0.1", options.pop("port", 0), **options)
        self.run(server.start())
        return server


def wait_until(condition: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def pool_is_whole(service: LocalService) -> bool:
    """Every KV block is back in the free queue: no request holds any."""
    pool = service.engine.kv_cache.pool
    return pool.num_free_blocks == pool.num_blocks


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("grpc-tiny-llama"))


@pytest.fixture(scope="session")
def tiny_config(tiny_model: Path) -> Callable[..., EngineConfig]:
    def config(num_blocks: int = 64, **scheduler: Any) -> EngineConfig:
        return EngineConfig(model=fp32_model(tiny_model),
                            cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                            scheduler=SchedulerConfig(**scheduler))
    return config


@pytest.fixture(scope="module")
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def service(server_loop: ServerLoop, tiny_config: Callable[..., EngineConfig]) -> Iterator[LocalService]:
    service = server_loop.start_service(tiny_config())
    yield service
    server_loop.run(service.stop())


@pytest.fixture(scope="module")
def server(server_loop: ServerLoop, service: LocalService) -> Iterator[GrpcServer]:
    server = server_loop.start_server(service)
    yield server
    server_loop.run(server.stop(0))


@pytest.fixture(scope="module")
def client(server: GrpcServer) -> Iterator[Client]:
    with Client(f"127.0.0.1:{server.port}", timeout=WAIT_S * 3) as client:
        yield client
