"""Tensor-parallel pools on the cluster path: a worker's actor runs rank 0 and spawns its other ranks on
its node; prompts prefilled and decoded by two-rank workers give the one-rank engine's tokens, the
KV crossing between them whole (every KV head), with nothing recomputed on the decode side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.engine.config import EngineConfig
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_engine_outputs import GREEDY, PROMPTS
from tests.ray_cluster.test_ray_cluster import alone, assert_pools_whole, engine_config_for, generate_all

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))  # 4 heads, 2 KV heads


def ranks_of(worker: Any) -> tuple[int, list[bool]]:
    """A worker actor's tensor-parallel size and whether each of its ranks' processes is alive."""
    import ray

    def look(actor: Any) -> tuple[int, list[bool]]:
        engine = actor.worker.engine
        processes = engine.ranks.processes if engine.ranks is not None else []
        return engine.config.model.tensor_parallel_size, [process.is_alive() for process in processes]

    return ray.get(worker.__ray_call__.remote(look), timeout=60)


def run_cluster(engine: EngineConfig, prefill_ranks: int, decode_ranks: int) -> list[list[int]]:
    """PROMPTS through a cluster of one prefill and one decode worker of these sizes: their tokens."""
    import ray

    config = ClusterConfig(
        prefill=PoolConfig(replicas=1, num_cpus=0.1, engine={"tensor_parallel_size": prefill_ranks}),
        decode=PoolConfig(replicas=1, num_cpus=0.1, engine={"tensor_parallel_size": decode_ranks}), engine=engine)
    cluster = Cluster(config).start()
    try:
        assert ranks_of(cluster.prefill[0]) == (prefill_ranks, [True] * (prefill_ranks - 1))
        assert ranks_of(cluster.decode[0]) == (decode_ranks, [True] * (decode_ranks - 1))
        got = generate_all(cluster, PROMPTS, GREEDY)
        assert ray.get(cluster.decode[0].load.remote(), timeout=30).kv_recomputes == 0
        transfers = ray.get(cluster.prefill[0].transfers.remote(), timeout=30)
        assert len(transfers) == len(PROMPTS)
        assert_pools_whole(cluster)
        return got
    finally:
        cluster.stop()


def test_two_rank_prefill_and_decode_pools_give_the_one_rank_engines_tokens(checkpoint: Path) -> None:
    engine = engine_config_for(checkpoint)
    assert run_cluster(engine, 2, 2) == alone(engine, PROMPTS, GREEDY)


def test_a_two_rank_prefill_pool_feeds_a_one_rank_decode_pool(checkpoint: Path) -> None:
    """The prefill worker's rank 0 gathers both ranks' KV heads into every frame it sends; the decode
    worker writes them into one cache."""
    engine = engine_config_for(checkpoint)
    assert run_cluster(engine, 2, 1) == alone(engine, PROMPTS, GREEDY)
