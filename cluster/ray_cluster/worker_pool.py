"""Making one worker of a pool as a Ray actor: what the launcher does for each worker at start, and
the scaler for each one it adds while the cluster runs."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from cluster.engine.config import EngineConfig
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.placement import worker_gpu_memory_utilization
from cluster.ray_cluster.worker_actor import RAY_NAMESPACE, worker_actor_class


def pool_threads(pool: PoolConfig) -> int:
    """The pool's threads per worker; 0 (follow the load) unless the operator fixed OMP_NUM_THREADS
    for the gateway, whose environment the workers of an embedded Ray inherit."""
    fixed = os.environ.get("OMP_NUM_THREADS", "")
    return pool.threads or (int(fixed) if fixed.isdigit() and int(fixed) > 0 else 0)


def actor_name(uid: str, role: str, index: int) -> str:
    """The Ray actor name of worker `index` of the pool of `role` in the cluster `uid`."""
    return f"pdserve-{uid}-{role}-{index}"


def pool_ranks(config: ClusterConfig, role: str) -> int:
    """The tensor-parallel ranks of each worker of the pool of `role`."""
    return config.engine_for(role).model.tensor_parallel_size


def worker_engine(config: ClusterConfig, role: str, num_gpus: float) -> EngineConfig:
    """The engine config of a worker of the pool of `role` on `num_gpus` GPUs per rank: its pool's
    (`ClusterConfig.engine_for`), with the share of its GPU's memory it may take where it shares one."""
    pool = config.prefill if role == "prefill" else config.decode
    engine = config.engine_for(role)
    ranks = engine.model.tensor_parallel_size
    if ranks > 1 and 0 < num_gpus < 1:
        raise ValueError(f"{role}: tensor_parallel_size {ranks} with num_gpus {num_gpus:g}: each rank computes on a "
                         "GPU of its own; give the pool whole GPUs (num_gpus 1) or tensor_parallel_size 1")
    utilization = worker_gpu_memory_utilization(config.engine.cache.gpu_memory_utilization,
                                                pool.engine.get("gpu_memory_utilization"), num_gpus, pool=role)
    return replace(engine, cache=replace(engine.cache, gpu_memory_utilization=utilization))


def worker_spec(config: ClusterConfig, role: str, pool: PoolConfig, num_gpus: float) -> tuple[Any, ...]:
    """All that makes a worker what it is: a named worker left running with the same is taken over."""
    return (role, worker_engine(config, role, num_gpus), config.redis_url, config.kv_overlap, pool.kv_interface,
            config.ucx_transports, pool.num_cpus, num_gpus, pool.resources, pool.max_concurrency,
            config.worker_max_restarts, pool.threads, config.kv_shared_memory, config.prefix_fetch)


def make_worker(config: ClusterConfig, uid: str, role: str, index: int, num_gpus: float,
                detached: bool = False) -> Any:
    """Start worker `index` of the pool of `role` (its actor; it loads its model on its first call).
    A named cluster's workers are detached (they outlive the gateway), and so are those the scaler
    adds (`detached`): an actor ends with the process that made it, and Ray restarts a scaler that
    died with no worker of its own."""
    pool = config.prefill if role == "prefill" else config.decode
    name = actor_name(uid, role, index)
    # The actor asks Ray for every rank's CPUs and GPUs: it runs rank 0 and spawns the others on its
    # own node (`cluster.model.ranks`), where they use what Ray gave it (CUDA_VISIBLE_DEVICES: its GPUs).
    ranks = pool_ranks(config, role)
    # max_task_retries=0: a stream cut by a worker's death is the router's to resume, not Ray's
    # to replay from its start.
    options = worker_actor_class().options(num_cpus=pool.num_cpus * ranks, num_gpus=num_gpus * ranks,
                                           resources=dict(pool.resources),
                                           name=name, namespace=RAY_NAMESPACE, max_restarts=config.worker_max_restarts,
                                           max_task_retries=0, max_concurrency=pool.max_concurrency,
                                           lifetime="detached" if config.name or detached else None)
    return options.remote(**worker_arguments(config, uid, role, index, num_gpus))


def worker_arguments(config: ClusterConfig, uid: str, role: str, index: int, num_gpus: float) -> dict[str, Any]:
    """The constructor arguments of worker `index` of the pool of `role` (`WorkerActor`): its pool's
    engine (`worker_engine`), transport and threads."""
    pool = config.prefill if role == "prefill" else config.decode
    return dict(worker_id=f"{role}-{index}", role=role, engine_config=worker_engine(config, role, num_gpus),
                redis_url=config.redis_url, overlap_transfer=config.kv_overlap, address=actor_name(uid, role, index),
                kv_interface=pool.kv_interface, ucx_transports=config.ucx_transports,
                spec=worker_spec(config, role, pool, num_gpus), traces=config.tracing, threads=pool_threads(pool),
                kv_shared_memory=config.kv_shared_memory, reserved_cpus=config.reserved_cpus,
                prefix_fetch=config.prefix_fetch and config.mode != "colocated")
