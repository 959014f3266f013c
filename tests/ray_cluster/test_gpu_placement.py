"""How many GPUs each worker asks Ray for, what memory share each then takes, and the refusal of pools
that can never be placed: pure functions of the config and of Ray's resource numbers, no Ray."""

from __future__ import annotations

import pytest

from cluster.cli import build_parser, cluster_overrides
from cluster.ray_cluster.config import load_cluster_config
from cluster.ray_cluster.placement import check_gpu_fit, gpus_per_worker, worker_gpu_memory_utilization
from cluster.ray_cluster.worker_pool import worker_engine


@pytest.mark.parametrize(("device", "asked", "ray_gpus", "usable", "expected"), [
    ("auto", None, 4.0, True, 1.0),  # one worker per GPU by default
    ("cuda", None, 1.0, True, 1.0),
    ("cuda:0", None, 0.0, True, 1.0),  # refused later by check_gpu_fit, not silently put on a CPU
    ("auto", None, 0.0, True, 0.0),  # auto on a Ray without GPUs: the CPU
    ("auto", None, 2.0, False, 0.0),  # GPUs torch cannot use here: the CPU
    ("cpu", None, 8.0, True, 0.0),
    ("auto", 0.5, 1.0, True, 0.5),  # sharing only where a pool asks for it
    ("cpu", 0.25, 0.0, True, 0.25),
])
def test_gpus_per_worker(device: str, asked: float | None, ray_gpus: float, usable: bool, expected: float) -> None:
    assert gpus_per_worker(device, asked, ray_gpus, usable) == expected


def test_workers_sharing_a_gpu_split_its_memory() -> None:
    assert worker_gpu_memory_utilization(0.9, None, 1.0) == 0.9
    assert worker_gpu_memory_utilization(0.9, None, 0.5) == pytest.approx(0.45)  # two on one GPU: 0.45 each
    assert worker_gpu_memory_utilization(0.9, None, 2.0) == 0.9  # whole GPUs: the share of each
    assert worker_gpu_memory_utilization(0.9, 0.3, 0.5) == 0.3  # the pool's own, within its share


def test_a_pool_utilization_past_its_gpu_share_is_refused() -> None:
    """Ray may put any workers whose fractions add up to 1 on one GPU: each worker's utilization must
    stay within its fraction, or their sum could pass the GPU."""
    with pytest.raises(ValueError, match=r"decode: gpu_memory_utilization 0.6 .* num_gpus 0.5"):
        worker_gpu_memory_utilization(0.9, 0.6, 0.5, pool="decode")


@pytest.mark.parametrize(("workers", "node_gpus", "fits"), [
    ([1.0, 1.0], [2.0], True),
    ([1.0, 1.0, 1.0, 1.0], [1.0], False),  # the Ray tests' 4 workers on a 1-GPU host
    ([0.5, 0.5, 0.5, 0.5], [2.0], True),
    ([0.6, 0.6], [1.0], False),  # 1.2 GPUs in all, but no GPU holds both
    ([0.6, 0.6], [1.0, 1.0], True),
    ([2.0], [1.0, 1.0], False),  # a worker's GPUs are on one node
    ([2.0, 0.5], [2.0, 1.0], True),
    ([0.0, 0.0], [], True),
])
def test_pools_that_ray_cannot_place_are_found(workers: list[float], node_gpus: list[float], fits: bool) -> None:
    if fits:
        check_gpu_fit(workers, node_gpus)
    else:
        with pytest.raises(ValueError, match="GPU"):
            check_gpu_fit(workers, node_gpus)


def test_serve_flag_and_pool_key_reach_the_engines() -> None:
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.8"])
    pool = {"decode": {"engine": {"gpu_memory_utilization": 0.4}}}
    config = load_cluster_config(None, {**cluster_overrides(args), **pool})
    assert config.engine_for("prefill").cache.gpu_memory_utilization == 0.8
    assert config.engine_for("decode").cache.gpu_memory_utilization == 0.4
    assert config.engine.cache.kv_cache_memory_gb is None  # GPUs are sized by the utilization, not a fixed size


def test_a_worker_on_half_a_gpu_gets_half_the_utilization() -> None:
    config = load_cluster_config(None, {"decode": {"num_gpus": 0.5}})
    assert worker_engine(config, "decode", 0.5).cache.gpu_memory_utilization == pytest.approx(0.45)
    assert worker_engine(config, "prefill", 1.0).cache.gpu_memory_utilization == 0.9


def test_the_test_sessions_clusters_run_on_the_cpu() -> None:
    """tests/conftest.py: a cluster built in a test that is not `gpu`-marked never asks Ray for GPUs."""
    from cluster.ray_cluster.config import ClusterConfig
    from cluster.ray_cluster.launcher import Cluster

    assert Cluster(ClusterConfig()).config.engine.model.device == "cpu"
    cuda = load_cluster_config(None, {"engine": {"device": "cuda"}})
    assert Cluster(cuda).config.engine.model.device == "cuda"  # asked for: kept (refused at start without GPUs)
