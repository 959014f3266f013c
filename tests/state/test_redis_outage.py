"""Redis dies or hangs under `ResilientState`: every call still answers quickly with its fallback, and
the state goes back to Redis by itself once Redis is back. Each test has a redis-server of its own."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import pytest

from cluster.common.block_hashes import prefix_hashes
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.state.connect import connect_state
from cluster.state.interface import WorkerInfo
from cluster.state.redis_state import RedisState
from cluster.state.resilient import ResilientState
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.worker import HEARTBEAT_TTL_S, Worker
from tests.helpers import fp32_model
from tests.state.conftest import RedisServer, free_port
from tests.state.test_shared_state import eventually, listed

T = TypeVar("T")
QUICK_S = 0.5  # a call's timeout is 0.25 s: twice that, for a loaded machine
RECOVERY_S = 15.0  # the backoff is 1 s doubling to 10 s: a short outage is over well within this
PREFILL = WorkerInfo("p1", "prefill", "actor-p1")


async def quickly(call: Awaitable[T]) -> T:
    start = time.monotonic()
    result = await call
    assert time.monotonic() - start < QUICK_S, "a call took longer than its timeout allows"
    return result


async def serves_fallbacks(state: ResilientState) -> None:
    """Every method, each within QUICK_S, with its safe answer."""
    assert await quickly(state.match([1, 2], ["p1"])) == {}
    # Rate limits fall back to this process's own buckets, never off.
    decisions = [await quickly(state.take("key", 1, rate_per_s=0.001, burst=1)) for _ in range(3)]
    assert [decision.allowed for decision in decisions] == [True, False, False]
    assert await quickly(state.workers()) == [PREFILL]  # the last list Redis gave
    await quickly(state.register(WorkerInfo("d1", "decode", "actor-d1"), ttl_s=30))
    assert [info.worker_id for info in await quickly(state.workers())] == ["d1", "p1"]  # and ours
    assert await quickly(state.workers("prefill")) == [PREFILL]
    await quickly(state.publish_blocks("p1", [3], []))
    assert await quickly(state.heartbeat("p1", ttl_s=30)) is True
    await quickly(state.deregister("d1"))
    assert await quickly(state.workers()) == [PREFILL]


async def is_back(state: ResilientState) -> bool:
    await state.match([1], ["p1"])
    return state.healthy


def test_redis_killed_then_restarted(dedicated_redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cluster.state.resilient")

    async def check() -> None:
        state = ResilientState(RedisState(dedicated_redis.url))
        await state.register(PREFILL, ttl_s=30)
        await state.publish_blocks("p1", [1, 2], [])
        assert await state.match([1, 2], ["p1"]) == {"p1": 2} and await state.workers() == [PREFILL]
        assert state.healthy and state.fallbacks.total() == 0

        dedicated_redis.stop()
        await serves_fallbacks(state)
        assert not state.healthy
        assert state.fallbacks["take"] == 3 and state.fallbacks["match"] == 1 and state.fallbacks.total() >= 11

        dedicated_redis.start()  # same port, empty
        assert await eventually(lambda: is_back(state), RECOVERY_S), "not back on Redis 15 s after it restarted"
        # Redis lost everything: a heartbeat of a worker registered here registers it again and says
        # it was not listed (its blocks are gone too).
        assert await state.match([1, 2], ["p1"]) == {"p1": 0}
        assert await state.heartbeat("p1", ttl_s=30) is False
        assert await state.primary.workers() == [PREFILL]
        await state.close()

    asyncio.run(check())
    messages = [record.getMessage() for record in caplog.records]
    assert sum("Redis unavailable" in m for m in messages) == 1, messages  # not one per fallback
    assert sum("Redis back" in m for m in messages) == 1, messages


def test_redis_hung_then_resumed(dedicated_redis: RedisServer) -> None:
    async def check() -> None:
        state = ResilientState(RedisState(dedicated_redis.url))
        await state.register(PREFILL, ttl_s=30)
        assert await state.workers() == [PREFILL]
        dedicated_redis.pause()
        try:
            await serves_fallbacks(state)  # the first call times out; the rest skip Redis
            assert not state.healthy
        finally:
            dedicated_redis.resume()
        assert await eventually(lambda: is_back(state), RECOVERY_S), "not back on Redis 15 s after it resumed"
        assert [info.worker_id for info in await state.workers()] == ["p1"]
        await state.close()

    asyncio.run(check())


def test_redis_never_there(caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: connections are refused

    async def check() -> None:
        state = ResilientState(RedisState(url))
        for _ in range(20):
            assert await quickly(state.match([1], ["p1"])) == {}
            assert await quickly(state.workers()) == []
        assert not state.healthy and state.fallbacks.total() == 40
        await state.close()

    caplog.set_level(logging.WARNING, logger="cluster.state.resilient")
    asyncio.run(check())
    assert sum("Redis unavailable" in record.getMessage() for record in caplog.records) == 1


def test_a_silent_worker_still_expires(redis_server: RedisServer) -> None:
    """Re-registering on heartbeat is for workers Redis lost, not for those that stopped beating."""

    async def check() -> None:
        state = ResilientState(RedisState(redis_server.url, prefix="silent", timeout_s=2.0), timeout_s=5.0)
        await state.register(PREFILL, ttl_s=0.3)

        async def gone() -> bool:
            return await listed(state) == []

        assert await eventually(gone)
        assert await state.heartbeat("p1", ttl_s=30) is False
        assert await listed(state) == []
        await state.close()

    asyncio.run(check())


def test_a_worker_publishes_its_cache_again_after_redis_restarts(dedicated_redis: RedisServer,
                                                                tmp_path: Path) -> None:
    """Redis restarts empty: the worker's heartbeat finds itself unlisted, and the worker lists itself
    and its whole prefix cache again, so KV-aware routing sees the prefix it still holds."""
    engine = LLMEngine(EngineConfig(model=fp32_model(build_tiny_llama_checkpoint(tmp_path)),
                                    cache=CacheConfig(block_size=4, num_blocks=64)))
    prompt = list(range(100, 120))  # 5 full blocks
    hashes = prefix_hashes(prompt, 4, engine.model_name)

    async def held(state: ResilientState) -> int:
        return (await state.match(hashes, ["w1"])).get("w1", 0)

    async def check() -> None:
        worker = Worker("w1", "colocated", engine, state=connect_state(dedicated_redis.url))
        reader = ResilientState(RedisState(dedicated_redis.url))
        await worker.start()
        try:
            async for _ in worker.generate("r1", prompt, SamplingParams(max_tokens=2)):
                pass
            assert await eventually(lambda: _equals(held(reader), len(hashes)))
            dedicated_redis.stop()
            dedicated_redis.start()  # same port, empty
            assert await eventually(lambda: _equals(held(reader), len(hashes)), RECOVERY_S + HEARTBEAT_TTL_S)
            assert [info.worker_id for info in await reader.workers()] == ["w1"]
        finally:
            await worker.stop()
            await reader.close()

    asyncio.run(check())


async def _equals(value: Awaitable[T], expected: T) -> bool:
    return await value == expected
