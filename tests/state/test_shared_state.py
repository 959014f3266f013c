"""The shared state's behaviour, the same against `InProcessState` and `RedisState` (a real server),
and what only Redis gives: replicas that see each other's writes."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import pytest

from cluster.state.connect import connect_state
from cluster.state.in_process import InProcessState
from cluster.state.interface import SharedState, WorkerInfo
from cluster.state.redis_state import RedisState
from cluster.state.resilient import ResilientState
from tests.state.conftest import RedisServer, StateFactory

EVENTUALLY_S = 5.0
BIG = 2**128 - 1  # block hashes are unsigned 128-bit (`cluster.common.block_hashes`)
HIGH = 7 + 2**64  # equal to 7 in its low 64 bits: the index must tell them apart


def run(factory: StateFactory, check: Callable[..., Awaitable[None]], replicas: int = 1, **options: object) -> None:
    """Builds `replicas` states inside a fresh event loop, runs `check(*states)`, closes them."""

    async def body() -> None:
        states = [factory(**options) for _ in range(replicas)]
        try:
            await check(*states)
        finally:
            for state in states:
                await state.close()

    asyncio.run(body())


async def eventually(condition: Callable[[], Awaitable[bool]], within_s: float = EVENTUALLY_S) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if await condition():
            return True
        await asyncio.sleep(0.05)
    return await condition()


async def listed(state: SharedState, role: str | None = None) -> list[str]:
    return [info.worker_id for info in await state.workers(role)]


# The prefix index


def test_match_counts_the_leading_run_of_held_blocks(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        await state.publish_blocks("w1", [11, 12, 13, BIG, HIGH], [])
        await state.publish_blocks("w2", [11, 12], [])
        assert await state.match([11, 12, 13, BIG, 99], ["w1", "w2", "w3"]) == {"w1": 4, "w2": 2, "w3": 0}
        assert await state.match([11, 12, 13, BIG, 7], ["w1"]) == {"w1": 4}
        assert await state.match([11, 12, 13, BIG, HIGH], ["w1"]) == {"w1": 5}
        # A block further down does not count once one before it is missing.
        assert await state.match([11, 99, 12], ["w1"]) == {"w1": 1}
        assert await state.match([], ["w1"]) == {"w1": 0}
        assert await state.match([11], []) == {}

    run(state_factory, check)


def test_evictions_open_a_gap(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        await state.publish_blocks("w1", [1, 2, 3, 4], [])
        await state.publish_blocks("w1", [5], [2])
        assert await state.match([1, 2, 3, 4, 5], ["w1"]) == {"w1": 1}
        # Stored, then evicted within one batch: absent.
        await state.publish_blocks("w1", [2, 6], [6])
        assert await state.match([1, 2, 3, 4, 5, 6], ["w1"]) == {"w1": 5}
        await state.publish_blocks("w1", [], [])  # an empty batch is fine

    run(state_factory, check)


def test_forget_worker_drops_only_its_blocks(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        await state.publish_blocks("w1", [1, 2], [])
        await state.publish_blocks("w2", [1, 2], [])
        await state.register(WorkerInfo("w1", "prefill", "a1"), ttl_s=30)
        await state.forget_worker("w1")
        assert await state.match([1, 2], ["w1", "w2"]) == {"w1": 0, "w2": 2}
        assert await listed(state) == ["w1"]

    run(state_factory, check)


def test_blocks_per_worker_are_capped(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        await state.publish_blocks("w1", list(range(1, 301)), [])
        held = await asyncio.gather(*(state.match([h], ["w1"]) for h in range(1, 301)))
        assert sum(answer["w1"] for answer in held) == 100

    run(state_factory, check, max_blocks_per_worker=100)


# The worker registry


def test_register_lists_by_role_and_deregister_unlists(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        decode = WorkerInfo("d1", "decode", "host-b:7000", {"zone": "b"})
        await state.register(WorkerInfo("p1", "prefill", "actor-p1"), ttl_s=30)
        await state.register(decode, ttl_s=30)
        assert await state.workers() == [decode, WorkerInfo("p1", "prefill", "actor-p1")]  # by id
        assert await listed(state, "decode") == ["d1"]
        assert await listed(state, "colocated") == []
        # Registering again replaces the info.
        await state.register(WorkerInfo("p1", "prefill", "actor-p1-bis"), ttl_s=30)
        assert [info.address for info in await state.workers("prefill")] == ["actor-p1-bis"]
        await state.publish_blocks("d1", [1], [])
        await state.deregister("d1")
        assert await listed(state) == ["p1"]
        assert await state.match([1], ["d1"]) == {"d1": 0}
        assert await state.heartbeat("d1", ttl_s=30) is False

    run(state_factory, check)


def test_heartbeats_extend_and_silence_expires(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        await state.register(WorkerInfo("w1", "colocated", "a"), ttl_s=0.5)
        assert await state.heartbeat("w1", ttl_s=30) is True
        await asyncio.sleep(0.8)  # past the registration's own ttl: the heartbeat carried it
        assert await listed(state) == ["w1"]
        await state.heartbeat("w1", ttl_s=0.3)

        async def gone() -> bool:
            return await listed(state) == []

        assert await eventually(gone), "the worker was still listed 5 s after a 0.3 s ttl"
        assert await state.heartbeat("w1", ttl_s=30) is False  # expired: register again

    run(state_factory, check)


def test_bad_input_is_refused_with_what_to_change(state_factory: StateFactory) -> None:
    with pytest.raises(ValueError, match="role"):
        WorkerInfo("w1", "router", "a")

    async def check(state: SharedState) -> None:
        with pytest.raises(ValueError, match="ttl_s"):
            await state.register(WorkerInfo("w1", "decode", "a"), ttl_s=0)
        with pytest.raises(ValueError, match="rate_per_s"):
            await state.take("k", 1, rate_per_s=0, burst=1)
        with pytest.raises(ValueError, match="finite"):
            await state.take("k", math.nan, rate_per_s=1, burst=1)

    run(state_factory, check)


# Rate limits


def test_a_bucket_allows_its_burst_then_says_when_to_retry(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        decisions = [await state.take("key-a", 1, rate_per_s=0.5, burst=3) for _ in range(4)]
        assert [d.allowed for d in decisions] == [True, True, True, False]
        assert decisions[0].remaining == pytest.approx(2, abs=0.1)
        # Refill is 0.5/s: the next token is at most 2 s away.
        assert 0 < decisions[3].retry_after_s <= 2.0 and decisions[3].remaining < 1
        # Another key has its own bucket.
        assert (await state.take("key-b", 3, rate_per_s=0.5, burst=3)).allowed

    run(state_factory, check)


def test_retry_after_is_the_time_until_the_whole_amount_is_there(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        # Tokens per minute: 1000 a minute, a request of 300 (prompt + max tokens).
        rate, burst = 1000 / 60, 1000.0
        for _ in range(3):
            assert (await state.take("tpm", 300, rate, burst)).allowed
        refused = await state.take("tpm", 300, rate, burst)
        assert not refused.allowed
        # 100 left: 200 more are 12 s away (less whatever trickled in meanwhile).
        assert 6 < refused.retry_after_s <= 12.0
        too_big = await state.take("tpm", 1001, rate, burst)
        assert not too_big.allowed and math.isinf(too_big.retry_after_s)
        assert (await state.take("tpm", 0, rate, burst)).allowed  # amount 0 only looks

    run(state_factory, check)


def test_a_bucket_refills_over_time(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        assert (await state.take("k", 1, rate_per_s=20, burst=1)).allowed
        refused = await state.take("k", 1, rate_per_s=20, burst=1)
        assert not refused.allowed and 0 < refused.retry_after_s <= 1 / 20
        await asyncio.sleep(refused.retry_after_s)

        async def allowed() -> bool:
            return (await state.take("k", 1, rate_per_s=20, burst=1)).allowed

        assert await eventually(allowed)

    run(state_factory, check)


def test_concurrent_takes_never_overdraw(state_factory: StateFactory) -> None:
    async def check(state: SharedState) -> None:
        decisions = await asyncio.gather(*(state.take("k", 1, rate_per_s=0.001, burst=10) for _ in range(50)))
        assert sum(d.allowed for d in decisions) == 10

    run(state_factory, check)


# Replicas sharing one Redis


def test_replicas_see_each_others_workers_and_blocks(redis_factory: StateFactory) -> None:
    async def check(one: SharedState, other: SharedState) -> None:
        await one.register(WorkerInfo("p1", "prefill", "a1"), ttl_s=30)
        await other.register(WorkerInfo("d1", "decode", "a2"), ttl_s=30)
        await one.publish_blocks("p1", [7, 8], [])
        assert await listed(one) == await listed(other) == ["d1", "p1"]
        assert await other.match([7, 8], ["p1"]) == {"p1": 2}
        await other.deregister("p1")
        assert await listed(one) == ["d1"]

    run(redis_factory, check, replicas=2)


def test_expired_workers_are_unlisted_from_the_members_set(redis_factory: StateFactory) -> None:
    async def check(state: RedisState) -> None:
        await state.register(WorkerInfo("w1", "decode", "a"), ttl_s=0.2)
        await state.register(WorkerInfo("w2", "decode", "a"), ttl_s=30)

        async def unlisted() -> bool:
            await state.workers()
            return await state.redis.smembers(state.members_key) == {"w2"}

        assert await eventually(unlisted)

    run(redis_factory, check)


def test_a_malformed_worker_record_is_skipped_and_logged_once(redis_factory: StateFactory,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    async def check(state: RedisState) -> None:
        await state.register(WorkerInfo("w1", "decode", "a"), ttl_s=30)
        await state.register(WorkerInfo("w2", "prefill", "b"), ttl_s=30)
        for worker_id, text in {"w3": "{not json", "w4": '{"worker_id": "w4"}', "w5": '["a list"]',
                                "w6": '{"worker_id": "w6", "role": "bogus", "address": "c"}'}.items():
            await state.redis.set(state.worker_key(worker_id), text)
            await state.redis.sadd(state.members_key, worker_id)
        assert await listed(state) == ["w1", "w2"]
        assert await listed(state, "decode") == ["w1"]

    with caplog.at_level("WARNING", logger="cluster.state.redis_state"):
        run(redis_factory, check)
    skipped = [record.getMessage() for record in caplog.records if "malformed worker record" in record.getMessage()]
    assert len(skipped) == 4 and all(f":worker:w{n}" in " ".join(skipped) for n in (3, 4, 5, 6)), skipped


def test_replicas_share_buckets_atomically(redis_factory: StateFactory) -> None:
    async def check(one: SharedState, other: SharedState) -> None:
        decisions = await asyncio.gather(*(state.take("k", 1, rate_per_s=0.001, burst=10)
                                           for _ in range(25) for state in (one, other)))
        assert sum(d.allowed for d in decisions) == 10
        refused = await other.take("k", 1, rate_per_s=0.001, burst=10)
        assert not refused.allowed and refused.retry_after_s > 900  # ~1000 s to the next token

    run(redis_factory, check, replicas=2)


def test_connect_state_picks_by_url(redis_server: RedisServer) -> None:
    async def check() -> None:
        assert isinstance(connect_state(None), InProcessState)
        assert isinstance(connect_state(""), InProcessState)
        state = connect_state(redis_server.url)
        assert isinstance(state, ResilientState)
        assert (await state.take("connect-state", 1, rate_per_s=1, burst=1)).allowed and state.healthy
        await state.close()

    asyncio.run(check())
