"""The cluster on a real local Ray: workers as actors, KV over UCX, tokens streamed by the router."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.cluster import Cluster
from cluster.cluster_config import ClusterConfig, PoolConfig, engine_config_from, load_cluster_config
from cluster.engine import LLMEngine
from cluster.sampling_params import SamplingParams
from tests.conftest import MAX_TOKENS
from tests.core.test_engine_outputs import GREEDY, PROMPTS
from tests.helpers import build_tiny_llama_checkpoint

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def generate_all(cluster: Cluster, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    async def one(index: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for event in cluster.generate(prompt, params, request_id=f"r{index}"):
            assert event.index == len(tokens)  # in order, each token once
            tokens += event.token_ids
        return tokens

    async def everything() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return asyncio.run(everything())


def assert_pools_whole(cluster: Cluster) -> None:
    import ray

    for free, total in ray.get([w.pool_state.remote() for w in cluster.prefill + cluster.decode], timeout=30):
        assert free == total


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_two_prefill_two_decode_equal_the_engine_alone(checkpoint: Path, mode: str) -> None:
    import ray

    engine_config = engine_config_from({"model": str(checkpoint), "block_size": 4, "num_blocks": 128})
    expected = [LLMEngine(engine_config).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    config = ClusterConfig(mode=mode, prefill=PoolConfig(replicas=2, num_cpus=0.1),
                           decode=PoolConfig(replicas=2, num_cpus=0.1), engine=engine_config)
    cluster = Cluster(config).start()
    try:
        assert generate_all(cluster, PROMPTS, GREEDY) == expected
        assert_pools_whole(cluster)
        if mode == "disaggregated":
            transfers = [t for w in cluster.prefill for t in ray.get(w.transfers.remote(), timeout=30)]
            assert len(transfers) == len(PROMPTS) and all(t.nbytes > 0 for t in transfers)
    finally:
        cluster.stop()


def test_a_dead_decode_worker_sends_requests_to_the_other(checkpoint: Path) -> None:
    import ray

    engine_config = engine_config_from({"model": str(checkpoint), "block_size": 4, "num_blocks": 128})
    expected = [LLMEngine(engine_config).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=2, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()
    try:
        ray.kill(cluster.decode[0])
        assert generate_all(cluster, PROMPTS, GREEDY) == expected
        assert ray.get(cluster.router.stats.remote(), timeout=30)["rerouted"] >= 1
        cluster.decode = cluster.decode[1:]
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


def test_lost_prefill_workers_leave_the_prompts_to_the_decode_workers(checkpoint: Path) -> None:
    import ray

    engine_config = engine_config_from({"model": str(checkpoint), "block_size": 4, "num_blocks": 128})
    expected = [LLMEngine(engine_config).generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    config = ClusterConfig(prefill=PoolConfig(replicas=2, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()
    try:
        ray.kill(cluster.prefill[0])  # one gone: the other prefills (or the decode worker recomputes)
        assert generate_all(cluster, PROMPTS, GREEDY) == expected
        ray.kill(cluster.prefill[1])  # all gone: every prompt is computed on the decode worker
        assert generate_all(cluster, PROMPTS, GREEDY) == expected
        assert ray.get(cluster.router.stats.remote(), timeout=30)["transfer_failed"] >= len(PROMPTS)
        cluster.prefill = []
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


@pytest.mark.slow
def test_default_model_through_the_disaggregated_path(default_prompts: list[list[int]],
                                                      transformers_greedy: list[list[int]]) -> None:
    config = ClusterConfig(prefill=PoolConfig(replicas=2, num_cpus=0.1), decode=PoolConfig(replicas=2, num_cpus=0.1),
                           engine=engine_config_from({"kv_cache_memory_gb": 0.25}))
    cluster = Cluster(config).start()
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        assert generate_all(cluster, default_prompts, params) == transformers_greedy
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


def test_config_file_with_overrides_and_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("mode: disaggregated\nprefill: {replicas: 2}\nengine: {dtype: bfloat16, block_size: 32}\n")
    config = load_cluster_config(path, {"decode": {"replicas": 3}})
    assert config.prefill.replicas == 2 and config.decode.replicas == 3
    assert config.engine.model.dtype == "bfloat16" and config.engine.cache.block_size == 32
    with pytest.raises(ValueError, match="unknown engine key 'blocksize'"):
        load_cluster_config(None, {"engine": {"blocksize": 8}})
    with pytest.raises(ValueError, match="mode must be one of"):
        load_cluster_config(None, {"mode": "split"})
    with pytest.raises(ValueError, match="decode.replicas must be >= 1"):
        load_cluster_config(None, {"decode": {"replicas": 0}})
    with pytest.raises(ValueError, match="unknown cluster config keys"):
        load_cluster_config(None, {"pools": 3})
