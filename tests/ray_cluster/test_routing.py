"""The router's choices: decode workers by load, prefill workers by prompt work and cached prefix."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.common.block_hashes import prefix_hashes
from cluster.common.errors import QueueFullError
from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.ray_cluster.router import Router, RouterConfig
from cluster.ray_cluster.routing_policy import decode_rank, prefill_cost
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks of 16


def test_prefix_hashes_are_chained_per_full_block() -> None:
    hashes = prefix_hashes(PROMPT, 16)
    assert len(hashes) == 2
    assert prefix_hashes(PROMPT[:32] + [1, 2, 3], 16) == hashes  # same full blocks, same hashes
    changed_first = prefix_hashes([7] + PROMPT[1:], 16)
    assert changed_first[0] != hashes[0] and changed_first[1] != hashes[1]  # a block's hash covers its prefix


def test_prefix_hashes_are_the_workers_cache_hashes(tmp_path: Path) -> None:
    engine = LLMEngine(EngineConfig(model=fp32_model(build_tiny_llama_checkpoint(tmp_path)),
                                    cache=CacheConfig(block_size=4, num_blocks=32)))
    engine.kv_cache.pool.record_events()
    prompt = list(range(10, 23))  # 3 full blocks of 4
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    stored = engine.kv_cache.pool.take_events().stored
    assert stored[:3] == prefix_hashes(prompt, 4, engine.model_name)
    assert engine.kv_cache.pool.take_events().stored == []  # taken once


def test_prefill_prefers_the_worker_with_the_prefix_unless_its_queue_outweighs_it() -> None:
    assert prefill_cost(queued_tokens=0, prompt_tokens=40, cached_blocks=2, block_size=16) == 8
    router = Router(prefill=[("p0", "actor-p0", "handle-0"), ("p1", "actor-p1", "handle-1")], decode=[],
                    config=RouterConfig())

    async def main() -> None:
        first = (await router._pick_prefill(PROMPT)).worker
        again = (await router._pick_prefill(PROMPT)).worker
        assert again == first and router.decisions["prefix_hits"] == 1
        router.queued_tokens[id(first)] = 1000  # busy with long prompts: the cached prefix is not worth the wait
        pick = await router._pick_prefill(PROMPT)
        assert pick.worker != first and pick.source is None  # prefix_fetch is off
        other = pick.worker
        router.dead.update({id(other), id(first)})
        assert (await router._pick_prefill(PROMPT)).worker is None  # none alive: the decode worker will recompute

    asyncio.run(main())


def test_a_prefix_cached_in_one_cache_domain_is_no_hit_for_another() -> None:
    """The router hashes a prompt in its request's domain, as the workers do: another tenant's (or
    salt's) copy of the prefix neither counts as a hit nor draws the request to that worker."""
    router = Router(prefill=[("p0", "actor-p0", "handle-0"), ("p1", "actor-p1", "handle-1")], decode=[],
                    config=RouterConfig())

    async def main() -> None:
        first = (await router._pick_prefill(PROMPT, cache_domain="tenant-a")).worker
        await router._pick_prefill(PROMPT, cache_domain="tenant-b")
        await router._pick_prefill(PROMPT)
        assert router.decisions["prefix_hits"] == 0
        assert (await router._pick_prefill(PROMPT, cache_domain="tenant-a")).worker == first
        assert router.decisions["prefix_hits"] == 1

    asyncio.run(main())


def test_with_prefix_fetch_a_busy_holders_prefix_is_fetched_by_the_idle_worker() -> None:
    """A prefix held elsewhere counts as held by every prefill worker: the one with the shorter queue
    takes the prompt and fetches the blocks it lacks from the holder, a draining or decode worker
    included; a worker holding the prefix itself wins a tie, and a block or less is not fetched."""
    long_prompt = list(range(100, 164))  # 4 full blocks of 16
    router = Router(prefill=[("p0", "actor-p0", "handle-0"), ("p1", "actor-p1", "handle-1")],
                    decode=[("d0", "actor-d0", "handle-d")], config=RouterConfig(prefix_fetch=True))

    async def main() -> None:
        hashes = prefix_hashes(long_prompt, 16)
        await router.state.publish_blocks("p0", hashes, [])
        pick = await router._pick_prefill(long_prompt)
        assert pick.worker == "handle-0" and pick.source is None  # a tie: the holder, nothing to fetch
        assert pick.work == 0  # every block is cached there: nothing of this prompt adds to its queue
        router.queued_tokens[id("handle-0")] = 40
        pick = await router._pick_prefill(long_prompt)
        source = pick.source
        assert pick.worker == "handle-1" and source is not None and pick.work == 0
        assert (source.worker, source.first_block, source.stop_block) == ("handle-0", 0, 4)
        await router.state.forget_worker("p1")  # without Redis the router records p1 holding the prompt now
        router.draining.add("p0")  # no new prompts, yet its cache can still be read
        assert (await router._pick_prefill(long_prompt)).source.worker == "handle-0"  # type: ignore[union-attr]
        router.dead.add(id("handle-0"))  # gone: nothing to fetch from, the prompt computes
        await router.state.forget_worker("p1")
        assert (await router._pick_prefill(long_prompt)).source is None
        await router.state.forget_worker("p1")
        await router.state.publish_blocks("d0", hashes, [])  # a decode worker holding a conversation
        assert (await router._pick_prefill(long_prompt)).source.worker == "handle-d"  # type: ignore[union-attr]
        await router.state.forget_worker("p1")
        await router.state.publish_blocks("p1", hashes[:3], [])
        pick = await router._pick_prefill(long_prompt)
        assert pick.source is None and pick.work == 64 - 3 * 16  # one block more: computed
        off = Router(prefill=[("p0", "actor-p0", "handle-0"), ("p1", "actor-p1", "handle-1")], decode=[],
                     config=RouterConfig())
        await off.state.publish_blocks("p0", hashes, [])
        off.queued_tokens[id("handle-0")] = 1000
        pick = await off._pick_prefill(long_prompt)
        assert (pick.worker, pick.source, pick.work) == ("handle-1", None, 64)

    asyncio.run(main())


def test_requests_arriving_together_spread_over_decode_workers_whatever_the_prefix_lookup_costs() -> None:
    """The decode workers are ranked by load after the prefix index answers (a Redis round trip), so
    requests that arrived together see each other in flight instead of all taking the first worker."""
    first, second = object(), object()
    router = Router([], [("decode-0", "actor-a", first), ("decode-1", "actor-b", second)], RouterConfig())

    async def slow_match(hashes: list[int], workers: list[str]) -> dict[str, int]:
        await asyncio.sleep(0.01)
        return {}

    router.state.match = slow_match  # type: ignore[method-assign]

    async def admit() -> object:
        ranked = await router._by_decode_prefix(router._decode_admitting(), PROMPT, "")
        router.in_flight[id(ranked[0])] = router.in_flight.get(id(ranked[0]), 0) + 1  # as `_holding` does
        return ranked[0]

    async def main() -> list[object]:
        return list(await asyncio.gather(admit(), admit()))

    assert set(asyncio.run(main())) == {first, second}


def test_a_prompt_queues_only_the_tokens_its_prefill_worker_computes() -> None:
    """Admitted by its whole prompt, a request counts (for admission and for the prefill worker's
    queue) only the part its prefill worker does not hold cached once the worker is picked, and
    nothing once its prefill ended."""
    from cluster.common.loads import KVTicket

    long_prompt = list(range(100, 164))  # 4 full blocks of 16
    router = Router([("p0", "actor-p0", "handle-0")], [("d0", "actor-d0", "handle-d")], RouterConfig())
    seen: dict[str, object] = {}

    async def stream(handle: object, method: str, *args: object):  # type: ignore[no-untyped-def]
        if method == "prefill":
            seen.update(ahead=dict(router.ahead), queued=router.queued_tokens.get(id(handle)))
        return
        yield

    router.channels.stream = stream  # type: ignore[method-assign]

    async def main() -> None:
        await router.state.publish_blocks("p0", prefix_hashes(long_prompt, 16)[:3], [])
        router._admit("r", len(long_prompt))
        async for _ in router._disaggregated("handle-d", KVTicket("address", "token"), "r", long_prompt,
                                             SamplingParams()):
            pass

    asyncio.run(main())
    assert seen == {"ahead": {"r": 16}, "queued": 16}
    assert router.queued_tokens[id("handle-0")] == 0 and not router.ahead


def test_decode_workers_rank_by_requests_then_queue_then_free_blocks() -> None:
    def load(waiting: int, free: int) -> WorkerLoad:
        return WorkerLoad("d", "decode", 0, waiting, free, 100, 1 - free / 100)

    ranks = {name: decode_rank(*args) for name, args in {
        "idle": (0, load(0, 90)), "fuller": (0, load(0, 10)), "queued": (0, load(3, 90)), "busy": (2, load(0, 99)),
        "unpolled": (1, None)}.items()}
    assert sorted(ranks, key=ranks.__getitem__) == ["idle", "fuller", "queued", "unpolled", "busy"]


def test_a_failed_transfer_is_logged_with_both_workers_and_the_first_says_why(caplog: pytest.LogCaptureFixture) -> None:
    prefill, decode = object(), object()
    router = Router([("prefill-0", "actor-p", prefill)], [("decode-0", "actor-d", decode)], RouterConfig())
    address = "ucx://127.0.0.1:4242"
    with caplog.at_level("WARNING", logger="cluster.ray_cluster.router"):
        router._warn_transfer_failed("req-1", prefill, decode, address, ConnectionError("refused"))
        router.decisions["transfer_failed"] += 1
        router._warn_transfer_failed("req-2", prefill, decode, address, ConnectionError("refused"))
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == ("KV of req-1 from prefill-0 to decode-0 at ucx://127.0.0.1:4242 failed (refused): "
                           "decode-0 recomputes the prompt")
    assert "first failed KV transfer since start: prefill-0 may not reach ucx://127.0.0.1:4242" in messages[1]
    assert len(messages) == 3  # the hint comes once


def test_prefix_hashes_cover_full_blocks_only_and_default_to_the_unnamed_model() -> None:
    from cluster.engine.block_pool import BlockPool
    from cluster.engine.kv_cache_manager import KVCacheManager
    from cluster.engine.request import Request

    prompt = list(range(3, 3 + 2 * 4 + 3))  # 2 full blocks of 4, then 3 tokens
    assert len(prefix_hashes(prompt, 4)) == 2
    manager = KVCacheManager(BlockPool(8), 4)  # a worker's cache, model name "" as the default
    request = Request("r", prompt, SamplingParams())
    assert manager.allocate_slots(request, len(prompt))
    assert prefix_hashes(prompt, 4) == manager.hashes_of["r"]


def test_a_new_request_goes_to_no_decode_worker_it_would_wait_on_too_long() -> None:
    """Wait = requests here beyond the slots, drained max_num_seqs at a time, each batch in a request's
    measured running time; a worker past max_decode_wait_s takes no new request, none: 429."""
    fast, slow = object(), object()
    router = Router([], [("decode-0", "actor-a", fast), ("decode-1", "actor-b", slow)],
                    RouterConfig(max_decode_wait_s=2.0))

    def load(seconds_per_request: float) -> WorkerLoad:
        return WorkerLoad("d", "decode", 4, 0, 50, 100, 0.5, seconds_per_request=seconds_per_request, max_num_seqs=4)

    assert router._decode_admitting() == [fast, slow]  # loads unknown yet: admitted
    router.loads = {id(fast): load(1.0), id(slow): load(3.0)}
    router.in_flight = {id(fast): 7, id(slow): 3}
    assert router._decode_wait_s(fast) == 1.0 and router._decode_wait_s(slow) == 0.0  # 4 beyond 4 slots; a free slot
    assert router._decode_admitting() == [slow, fast]
    router.in_flight = {id(fast): 12, id(slow): 6}  # 9 / 4 * 1 s; 3 / 4 * 3 s
    assert router._decode_wait_s(fast) == 2.25 and router._decode_wait_s(slow) == 2.25
    with pytest.raises(QueueFullError, match="the decode workers have 2.2 s of requests queued"):
        router._decode_admitting()
    assert router.decisions["refused_overloaded"] == 1
    router.dead.add(id(fast))
    router.in_flight[id(slow)] = 5
    assert router._decode_admitting() == [slow]  # 2 / 4 * 3 s = 1.5 s
    assert Router([], [("decode-0", "a", fast)], RouterConfig(max_decode_wait_s=0))._decode_admitting() == [fast]


def test_a_prefix_in_a_workers_host_tier_stays_in_the_prefix_index_until_the_tier_drops_it(tmp_path: Path) -> None:
    """Routers send a prefix to the worker that holds it, in its pool or its host KV tier: the pool's
    eviction into the tier withdraws nothing; the tier's own eviction does."""
    from cluster.state.in_process import InProcessState

    engine = LLMEngine(EngineConfig(model=fp32_model(build_tiny_llama_checkpoint(tmp_path)),
                                    cache=CacheConfig(block_size=4, num_blocks=8, num_host_kv_blocks=4)))
    pool, state = engine.kv_cache.pool, InProcessState()
    pool.record_events()
    params = SamplingParams(max_tokens=1, temperature=0)
    prompt = list(range(10, 19))  # 2 full blocks of 4
    hashes = prefix_hashes(prompt, 4, engine.model_name)

    def run(prompt: list[int]) -> int:
        engine.generate([prompt], params)
        events = pool.take_events()
        asyncio.run(state.publish_blocks("w", events.stored, events.evicted))
        return asyncio.run(state.match(hashes, ["w"]))["w"]

    assert run(prompt) == 2
    others = iter(list(range(start, start + 9)) for start in range(30, 300, 20))
    while any(block_hash in pool.cached for block_hash in hashes):
        assert run(next(others)) == 2  # still in the pool, or already in the tier: held
    assert all(block_hash in pool.host_tier for block_hash in hashes)  # type: ignore[operator]
    while any(block_hash in pool.host_tier for block_hash in hashes):  # type: ignore[operator]
        run(next(others))
    assert run(next(others)) == 0 and not set(hashes) & set(pool.held_hashes())  # the tier's LRU dropped them
