"""The host KV tier on a real Ray cluster (1 prefill + 1 decode worker): the prefill worker's pool is
too small for the workload's prefixes, so each has left it by the time it comes back, and is served
from the worker's host tier; the tokens are those of an engine alone, and every pool ends whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_host_kv_tier import BLOCK_SIZE, WORKLOAD
from tests.helpers import fp32_engine
from tests.ray_cluster.test_ray_cluster import alone, assert_pools_whole, generate_all

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("host-tier-ray"), num_layers=2, hidden=64, heads=4,
                                       kv_heads=2)


def test_a_prefix_evicted_from_the_prefill_workers_pool_is_served_from_its_host_tier(checkpoint: Path,
                                                                                    tmp_path: Path) -> None:
    """The tier on local disk (`host_kv_disk_dir`): the engine tests show it equals the tier in memory."""
    engine = fp32_engine(checkpoint, block_size=BLOCK_SIZE, num_blocks=256)
    disk = tmp_path / "host-kv"
    config = ClusterConfig(
        prefill=PoolConfig(replicas=1, num_cpus=0.1, engine={"num_blocks": 16, "num_host_kv_blocks": 64,
                                                             "host_kv_disk_dir": str(disk)}),
        decode=PoolConfig(replicas=1, num_cpus=0.1), engine=engine)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = alone(engine, WORKLOAD, params)
    cluster = Cluster(config).start()
    try:
        # One at a time: each prefix's second turn comes after seven others went through the pool of 16.
        tokens = [generate_all(cluster, [prompt], params)[0] for prompt in WORKLOAD]
        assert tokens == expected
        loads = {load.role: load for load in asyncio.run(cluster.workers())}
        prefill = loads["prefill"]
        assert prefill.num_host_kv_blocks == 64 and loads["decode"].num_host_kv_blocks == 0
        assert prefill.host_kv_hits == 8 * 5 * BLOCK_SIZE and prefill.host_kv_promoted == 8 * 5
        assert prefill.prefix_cache_hits >= prefill.host_kv_hits
        assert disk.is_dir() and not list(disk.iterdir())  # made there, unlinked once mapped
        assert_pools_whole(cluster)
    finally:
        cluster.stop()
