"""Router replicas: several routers over one set of pools, and a second cluster (as a second gateway
would run) that starts no workers and finds them in the registry the workers keep in Redis."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.ray_cluster.worker_actor import RAY_NAMESPACE, worker_actor_class
from cluster.serving.process import gateway_metrics
from cluster.state.connect import connect_state
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_engine_outputs import GREEDY, PROMPTS
from tests.observability.scrape import samples, value
from tests.ray_cluster.conftest import wait_for
from tests.ray_cluster.test_ray_cluster import alone, assert_pools_whole, collect_tokens, engine_config_for

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def served(cluster: Cluster, prefix: str) -> tuple[list[list[int]], set[str]]:
    """Every prompt's tokens, all at once, and the workers that sent them."""
    workers: set[str] = set()

    async def one(index: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for event in cluster.generate(prompt, GREEDY, request_id=f"{prefix}-{index}"):
            assert event.index == len(tokens)
            tokens += event.token_ids
            workers.add(event.worker_id)
        return tokens

    async def everything() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))

    return asyncio.run(everything()), workers


def live_workers(router: Any) -> list[str]:
    import ray

    return list(ray.get(router.live_workers.remote(), timeout=30))


def registered(url: str) -> list[str]:
    async def listed() -> list[str]:
        state = connect_state(url)
        try:
            return [info.worker_id for info in await state.workers()]
        finally:
            await state.close()

    return asyncio.run(listed())


def assert_one_series_per_worker_and_phases_where_they_ran(owner: Cluster, attached: Cluster, requests: int) -> None:
    """Both gateways' /metrics, kept apart by gateway as Prometheus keeps them: each worker is one
    series, and each request's phases were counted once, on the worker where they ran (the
    histograms crossed Ray in the workers' loads)."""

    async def scrape(cluster: Cluster, gateway: str) -> dict:
        text = await gateway_metrics(cluster.model_name, cluster.config).exposition(await cluster.workers())
        return {(name, (("gateway", gateway), *labels)): v for (name, labels), v in samples(text.decode()).items()}

    both = asyncio.run(scrape(owner, "owner")) | asyncio.run(scrape(attached, "attached"))
    for worker in ("prefill-0", "decode-0"):
        assert len([k for k in both if k[0] == "vllm:num_requests_running" and ("worker", worker) in k[1]]) == 1
    for phase in ("queue", "prefill", "decode", "inference"):  # inference: once on each of the two
        counted = value(both, f"vllm:request_{phase}_time_seconds_count")
        assert counted == requests * (2 if phase == "inference" else 1), phase
    assert value(both, "vllm:request_decode_time_seconds_count", worker="prefill-0") == 0
    assert value(both, "vllm:request_queue_time_seconds_count", worker="decode-0") == 0
    # Every KV transfer's exposed part, timed on the prefill worker that sent it.
    assert value(both, "pdserve:kv_transfer_exposed_seconds_count", worker="prefill-0") == \
        value(both, "pdserve:kv_transfers_total", worker="prefill-0") == requests


def write_malformed_worker_records(url: str) -> None:
    """Records under the registry's keys that are no worker's: not JSON, a field missing, a bad role."""
    import json

    import redis

    client = redis.Redis.from_url(url)
    records = {"junk-text": "{not json", "junk-fields": json.dumps({"worker_id": "junk-fields"}),
               "junk-role": json.dumps({"worker_id": "junk-role", "role": "bogus", "address": "x"})}
    for worker_id, text in records.items():
        client.set(f"pdserve:worker:{worker_id}", text)
        client.sadd("pdserve:workers", worker_id)
    client.close()


def test_router_replicas_and_an_attached_cluster_share_the_workers(checkpoint: Path, dedicated_redis: Any) -> None:
    """Two routers and an attached cluster serve the same workers; Redis killed under load and
    restarted leaves every request served (routing by load alone meanwhile) and the registry whole
    again; a worker that joins later is found by every router; when the first gateway restarts with
    new workers, the attached cluster routes to them."""
    import ray

    redis_server = dedicated_redis
    engine_config = engine_config_for(checkpoint)
    expected = alone(engine_config, PROMPTS, GREEDY)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, redis_url=redis_server.url, routers=2)
    first = Cluster(config).start()
    second = Cluster(ClusterConfig(engine=engine_config, redis_url=redis_server.url, attach=True)).start()
    extra = None
    try:
        assert served(first, "a")[0] == expected  # the cluster sends them round-robin to its two routers
        assert second.model_name == first.model_name
        assert live_workers(second.router) == ["decode-0", "prefill-0"]
        assert served(second, "b")[0] == expected
        assert_one_series_per_worker_and_phases_where_they_ran(first, second, requests=2 * len(PROMPTS))

        async def redis_killed_under_load() -> list[list[int]]:
            run = asyncio.gather(*(collect_tokens(first, p, f"outage-{i}") for i, p in enumerate(PROMPTS)))
            await asyncio.sleep(0.2)
            redis_server.stop()
            return list(await asyncio.wait_for(run, 120))

        assert asyncio.run(redis_killed_under_load()) == expected
        assert served(first, "while-down")[0] == expected
        redis_server.start()  # empty: the workers list themselves and their caches again
        wait_for(lambda: registered(redis_server.url) == ["decode-0", "prefill-0"], "not registered again")
        assert asyncio.run(first.router_stats())["counters"]["pdserve:router_redis_fallbacks"] > 0

        # A decode worker that joins later is found in the registry by every router, past records that
        # are not a worker's (skipped and logged, not the end of the routers' polling); with the first
        # decode worker gone for good, the new one serves both clusters.
        write_malformed_worker_records(redis_server.url)
        name = f"pdserve-{first.uid}-decode-extra"
        extra = worker_actor_class().options(name=name, namespace=RAY_NAMESPACE, num_cpus=0.1).remote(
            "decode-extra", "decode", engine_config, redis_url=redis_server.url, address=name)
        ray.get(extra.start.remote(), timeout=120)
        for router in first.routers + second.routers:
            wait_for(lambda router=router: "decode-extra" in live_workers(router), "the new worker was not found")
        ray.kill(first.decode[0])
        tokens, workers = served(second, "c")
        assert tokens == expected and "decode-extra" in workers
        assert asyncio.run(collect_tokens(first, PROMPTS[0], "d")) == expected[0]

        first.decode = [extra]
        assert_pools_whole(first)

        # The first gateway restarts: its workers go, new actors come under the same ids, and the
        # attached cluster's router swaps them in.
        first.stop()
        first = Cluster(replace(config, routers=1)).start()
        wait_for(lambda: live_workers(second.router) == ["decode-0", "prefill-0"], "the new actors were not found")
        assert served(second, "f")[0] == expected
        second.stop()  # an attached cluster leaves the workers running
        assert asyncio.run(collect_tokens(first, PROMPTS[1], "g")) == expected[1]
        assert_pools_whole(first)
    finally:
        second.stop()
        first.stop()
        if extra is not None:
            ray.kill(extra)
