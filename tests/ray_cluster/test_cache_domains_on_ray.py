"""Cache domains on the cluster path: the domain a front door gives a request (its cache_salt, its
tenant) travels with it through the router to the prefill and decode workers. Requests of two
domains share no prefix blocks on a worker, and the router's KV-aware routing counts no hit across
domains; requests of one domain still find their blocks, and the worker that holds them."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_engine_outputs import GREEDY
from tests.helpers import fp32_engine

pytestmark = pytest.mark.usefixtures("ray_session")

PROMPT = list(range(200, 240)) + [7]  # 41 tokens: ten full blocks of 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def run_in(cluster: Cluster, domain: str, request_id: str) -> tuple[int, str, int]:
    """PROMPT in `domain`: its cached prompt tokens, the prefill worker that sent its first token,
    and the router's prefix hits after it."""
    import ray

    async def one() -> tuple[int, str]:
        cached, worker = 0, ""
        async for event in cluster.generate(PROMPT, replace(GREEDY, max_tokens=2, cache_domain=domain),
                                            request_id=request_id):
            worker = worker or event.worker_id
            cached = max(cached, event.num_cached_tokens)
        return cached, worker

    cached, worker = asyncio.run(one())
    return cached, worker, dict(ray.get(cluster.router.stats.remote(), timeout=30))["prefix_hits"]


def test_two_cache_domains_share_no_blocks_on_the_workers_and_no_hits_in_routing(checkpoint: Path) -> None:
    config = ClusterConfig(prefill=PoolConfig(replicas=2, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=fp32_engine(checkpoint, block_size=4, num_blocks=128))
    cluster = Cluster(config).start()
    try:
        cached, tenant_a_worker, hits = run_in(cluster, '{"tenant": "a"}', "a-1")
        assert (cached, hits) == (0, 0)
        cached, _, hits = run_in(cluster, '{"tenant": "b"}', "b-1")
        assert (cached, hits) == (0, 0)  # A's blocks are neither found by the worker nor counted by the router
        cached, worker, hits = run_in(cluster, '{"tenant": "a"}', "a-2")
        assert (cached, worker, hits) == (40, tenant_a_worker, 1)  # within a domain: routed to its blocks, found
        cached, _, hits = run_in(cluster, "", "shared-1")
        assert (cached, hits) == (0, 1)
    finally:
        cluster.stop()
