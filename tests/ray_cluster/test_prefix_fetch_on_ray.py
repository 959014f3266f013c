"""Prefix fetch on the cluster path (2 prefill + 1 decode workers on Ray, KV over UCX): a prompt whose
beginning one prefill worker caches goes, once that worker drains, to the other, which fetches those
blocks over the KV transfer from a worker holding them instead of computing them. Tokens are the engine alone's, nothing
is recomputed on the decode side, the counters and /metrics say what travelled, and every pool is whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.serving.process import gateway_metrics
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_engine
from tests.observability.scrape import samples, value
from tests.ray_cluster.test_ray_cluster import assert_pools_whole

pytestmark = pytest.mark.usefixtures("ray_session")
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
DOCUMENT = list(range(10, 51))  # 41 tokens: ten full blocks of 4 and one token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


async def run(cluster: Cluster, prompt: list[int], request_id: str) -> list[int]:
    tokens: list[int] = []
    async for event in cluster.generate(prompt, PARAMS, request_id=request_id):
        assert event.index == len(tokens)
        tokens += event.token_ids
    return tokens


def test_a_prefix_cached_elsewhere_is_fetched_not_computed(checkpoint: Path) -> None:
    import ray

    engine = fp32_engine(checkpoint, block_size=4, num_blocks=128)
    config = ClusterConfig(prefill=PoolConfig(replicas=2, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine, prefix_fetch=True)
    alone = LLMEngine(engine)
    cluster = Cluster(config).start()
    try:
        assert asyncio.run(run(cluster, DOCUMENT, "first")) == alone.generate([DOCUMENT], PARAMS)[0].token_ids
        loads = {load.worker_id: load for load in asyncio.run(cluster.workers())}
        (holder,) = [name for name, load in loads.items() if load.role == "prefill" and load.kv_transfers]
        (fetcher,) = [name for name, load in loads.items() if load.role == "prefill" and name != holder]
        ray.get(cluster.routers[0].drain_worker.remote(holder))  # new prompts go to the other one
        prompt = DOCUMENT + list(range(60, 75))  # 56 tokens: 14 blocks, the first 10 cached on the holder
        assert asyncio.run(run(cluster, prompt, "second")) == alone.generate([prompt], PARAMS)[0].token_ids
        loads = {load.worker_id: load for load in asyncio.run(cluster.workers())}
        assert loads[fetcher].prefix_blocks_fetched == 10
        assert loads[fetcher].prefix_cache_hits >= 40  # the fetched blocks were found, not computed
        # From a worker holding it: the draining one, or the decode worker, which the router (without
        # Redis) records holding the prompt it reserved; either had the ten blocks, no more.
        assert sum(load.prefix_blocks_offered for load in loads.values()) == 10
        assert not any(load.kv_recomputes for load in loads.values())
        assert asyncio.run(cluster.router_stats())["decisions"]["prefix_fetches"] == 1
        scraped = samples(asyncio.run(gateway_metrics("tiny", config).exposition(list(loads.values()))).decode())
        assert value(scraped, "pdserve:prefix_blocks_fetched_total", role="prefill") == 10
        assert_pools_whole(cluster)
    finally:
        cluster.stop()
