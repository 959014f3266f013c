"""The live controller on Ray: a load step grows the decode pool and requests go to the new worker;
a controller that dies comes back with the pools it had; removing a worker drains it, with every
request answered in full and every block back in its pool; a warm spare is routed to at once."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig, PoolBounds, PoolConfig, ScalingConfig
from cluster.ray_cluster.launcher import Cluster, named_workers
from cluster.ray_cluster.worker_actor import RAY_NAMESPACE
from cluster.serving.process import gateway_metrics
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_engine_outputs import PROMPTS
from tests.observability.scrape import samples
from tests.ray_cluster.conftest import pace_steps
from tests.ray_cluster.test_ray_cluster import alone, assert_pools_whole, engine_config_for

pytestmark = pytest.mark.usefixtures("ray_session")
STEP_S = 0.02  # a larger model's decode step: the load step lasts while the controller looks
SCALING = ScalingConfig(enabled=True, prefill=PoolBounds(1, 1), decode=PoolBounds(1, 2), queue_depth=1.0, ttft_s=0,
                        itl_s=0, sustain_s=0.5, cooldown_s=60.0, interval_s=0.2, drain_timeout_s=60.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


class Wave:
    """Requests sent at once, each one's tokens and the workers that streamed them."""

    def __init__(self, cluster: Cluster, name: str, prompts: list[list[int]], params: SamplingParams) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.workers: list[set[str]] = [set() for _ in prompts]
        self.tasks = [asyncio.create_task(self._one(cluster, f"{name}-{i}", i, p, params))
                      for i, p in enumerate(prompts)]

    async def _one(self, cluster: Cluster, request_id: str, index: int, prompt: list[int],
                   params: SamplingParams) -> None:
        async for event in cluster.generate(prompt, params, request_id=request_id):
            assert event.index == len(self.tokens[index])  # in order, each token once
            self.tokens[index] += event.token_ids
            self.workers[index].add(event.worker_id)

    async def done(self) -> list[list[int]]:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 60)
        return self.tokens


async def until(condition: Any, what: str, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while not await condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_a_load_step_adds_a_decode_worker_and_removing_it_drains_every_request(checkpoint: Path) -> None:
    import ray

    engine_config = engine_config_for(checkpoint, num_blocks=512)
    engine_config = replace(engine_config, scheduler=replace(engine_config.scheduler, max_num_seqs=2))
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = (PROMPTS * 3)[:8]
    expected = alone(engine_config, prompts, params)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, max_decode_wait_s=0, max_prefill_wait_s=0, scaling=SCALING)
    cluster = Cluster(config).start()
    ray.get(cluster.decode[0].__ray_call__.remote(pace_steps(STEP_S)), timeout=30)

    async def pools() -> dict[str, int]:
        return (await cluster.scaling()).get("pools", {})

    async def back_with_its_pools() -> bool:  # restarted, its pools recovered, looking again
        status = await cluster.scaling()
        return bool(status.get("restarted")) and status["pools"] == {"decode": 2, "prefill": 1} \
            and status["looks"] > 0

    async def scenario() -> tuple[Wave, Wave]:
        step = Wave(cluster, "step", prompts, params)  # 8 requests on 2 slots: 6 wait
        await until(lambda: _is(pools(), "decode", 2), "the controller never added a decode worker")
        added = ray.get_actor(f"pdserve-{cluster.uid}-decode-1", namespace=RAY_NAMESPACE)
        await added.__ray_call__.remote(pace_steps(STEP_S))
        assert ["decode", "up", "queue_depth", 1] in (await cluster.scaling())["decisions"]
        ray.kill(cluster.scaler, no_restart=False)  # Ray restarts it: with the workers it had added?
        await until(back_with_its_pools, "the controller did not come back with decode-1 in its pool")
        after = Wave(cluster, "after", prompts[:4], params)  # decode-0 is still busy with the step
        await until(lambda: _streaming_on(after, "decode-1"), "no request went to the new worker")
        removed = await cluster.scaler.scale.remote("decode", "down")  # by the restarted controller, busy
        assert removed == "decode-1"
        assert await step.done() == expected and await after.done() == expected[:4]  # every token, none twice
        return step, after

    try:
        step, after = asyncio.run(scenario())
        assert any("decode-1" in workers for workers in after.workers)
        status = asyncio.run(cluster.scaling())
        assert status["pools"] == {"decode": 1, "prefill": 1}
        assert status["drained"] == [{"worker": "decode-1", "emptied": True, "free_blocks": 512, "blocks": 512}]
        assert status["last"]["direction"] == "down" and status["last"]["worker"] == "decode-1"
        assert sorted(ray.get(cluster.router.live_workers.remote(), timeout=30)) == ["decode-0", "prefill-0"]
        assert_pools_whole(cluster)
        text = asyncio.run(_scrape(cluster))
        documented = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
        families = {"pdserve:scaling_decisions", "pdserve:pool_workers"}
        assert families <= {family.name for family in text_string_to_metric_families(text)}
        assert all(f"`{name}`" in documented for name in families)
        scraped = samples(text)
        # The up decision came before the controller's restart: its successor counts on from its checkpoint.
        assert {labels: v for (name, labels), v in scraped.items() if name == "pdserve:scaling_decisions_total"} == {
            (("direction", "down"), ("pool", "decode"), ("reason", "manual")): 1.0,
            (("direction", "up"), ("pool", "decode"), ("reason", "queue_depth")): 1.0}
        assert [(d["direction"], d["worker"]) for d in status["history"]] == [("up", "decode-1"), ("down", "decode-1")]
        assert {labels: v for (name, labels), v in scraped.items() if name == "pdserve:pool_workers"} == {
            (("pool", "decode"),): 1.0, (("pool", "prefill"),): 1.0}
    finally:
        cluster.stop()


def test_a_warm_spare_takes_no_requests_until_the_step_then_serves_at_once(checkpoint: Path) -> None:
    """`warm_spares: 1`: decode-1 starts with the cluster, unrouted; the step routes to it within a
    look of the decision (no model load between), the spare is made up again after the pool shrinks,
    and a stop ends it too."""
    import ray

    engine_config = engine_config_for(checkpoint, num_blocks=256)
    engine_config = replace(engine_config, scheduler=replace(engine_config.scheduler, max_num_seqs=2))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = (PROMPTS * 3)[:8]
    expected = alone(engine_config, prompts, params)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, max_decode_wait_s=0, max_prefill_wait_s=0,
                           scaling=replace(SCALING, warm_spares=1))
    cluster = Cluster(config).start()

    async def spares(ids: list[str]) -> bool:
        status = await cluster.scaling()
        return status.get("spares", {}).get("decode") == ids and not status["starting"]["decode"]

    async def scenario() -> None:
        await until(lambda: spares(["decode-1"]), "no warm spare started")
        assert sorted(await cluster.router.live_workers.remote()) == ["decode-0", "prefill-0"]  # not routed to
        scraped = samples(await _scrape(cluster))
        assert {labels: v for (name, labels), v in scraped.items() if name == "pdserve:pool_spares"} == {
            (("pool", "decode"),): 1.0, (("pool", "prefill"),): 0.0}
        for index in (0, 1):
            worker = ray.get_actor(f"pdserve-{cluster.uid}-decode-{index}", namespace=RAY_NAMESPACE)
            await worker.__ray_call__.remote(pace_steps(STEP_S))
        step = Wave(cluster, "step", prompts, params)  # 8 requests on 2 slots: 6 wait
        await until(lambda: _is(_pools(cluster), "decode", 2), "the step did not enable the spare")
        after = Wave(cluster, "after", prompts[:4], params)  # decode-0 is still busy with the step
        await until(lambda: _streaming_on(after, "decode-1"), "no request went to the spare")
        assert await step.done() == expected and await after.done() == expected[:4]  # every token, none twice
        assert await spares([])  # two serving: max_workers 2 leaves no room for another
        assert await cluster.scaler.scale.remote("decode", "down") == "decode-1"
        await until(lambda: spares(["decode-2"]), "the spare was not made up again after the pool shrank")

    try:
        asyncio.run(scenario())
        grown = asyncio.run(cluster.scaling())["history"][0]
        phases = grown["phases"]
        assert grown["worker"] == "decode-1" and phases["spare"] is True
        assert phases["made_at"] < phases["warmed_at"] < phases["signal_at"] <= phases["decided_at"]  # ready before
        assert phases["routed_at"] - phases["decided_at"] < 1.0  # routed to at once: no model load in between
        assert_pools_whole(cluster)
    finally:
        cluster.stop()

    async def all_ended() -> bool:
        return named_workers(cluster.uid) == []

    asyncio.run(until(all_ended, "a worker outlived the stop (the spare?)", within_s=10))


def test_a_controller_killed_while_it_adds_a_worker_comes_back_with_that_worker_serving(checkpoint: Path) -> None:
    """Killed between its decision and the routers routing to the new worker: the successor counts
    the decision, lists it as interrupted, warms the half-started worker up and routes to it."""
    import ray

    engine_config = engine_config_for(checkpoint, num_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = alone(engine_config, PROMPTS[:4], params)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, max_decode_wait_s=0, max_prefill_wait_s=0, scaling=SCALING)
    cluster = Cluster(config).start()

    async def starting() -> bool:
        return bool((await cluster.scaling())["starting"]["decode"])

    async def back() -> bool:
        status = await cluster.scaling()
        return bool(status.get("restarted")) and status["looks"] > 0

    async def scenario() -> dict[str, Any]:
        cluster.scaler.scale.remote("decode", "up")  # dies with its controller
        await until(starting, "the controller never started a decode worker")
        ray.kill(cluster.scaler, no_restart=False)
        await until(back, "the controller did not come back")
        live = await cluster.router.live_workers.remote()
        assert sorted(live) == ["decode-0", "decode-1", "prefill-0"]
        wave = Wave(cluster, "after", PROMPTS[:4], params)
        assert await wave.done() == expected
        return await cluster.scaling()

    try:
        status = asyncio.run(scenario())
        assert status["pools"] == {"decode": 2, "prefill": 1}
        assert ["decode", "up", "manual", 1] in status["decisions"]
        assert [(d["direction"], d["worker"], d.get("interrupted")) for d in status["history"]] == [
            ("up", "decode-1", True)]
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


async def _pools(cluster: Cluster) -> dict[str, int]:
    return (await cluster.scaling()).get("pools", {})


async def _is(sizes: Any, pool: str, size: int) -> bool:
    return (await sizes).get(pool) == size


async def _streaming_on(wave: Wave, worker_id: str) -> bool:
    return any(worker_id in workers and len(tokens) >= 3 for workers, tokens in zip(wave.workers, wave.tokens,
                                                                                    strict=True))


async def _scrape(cluster: Cluster) -> str:
    metrics = gateway_metrics(cluster.model_name, cluster.config)
    metrics.sources.append(cluster.router_stats)
    return (await metrics.exposition(await cluster.workers())).decode()
