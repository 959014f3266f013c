"""The soak against the Ray cluster: mixed traffic (streams, cancels, dropped streams, invalid requests,
stops, logprobs: `cluster.bench.soak`) through the HTTP gateway to 1 prefill + 2 decode workers, while
a decode worker's process is killed and Redis (the routers' shared state) is killed and restarted
empty. Every request must end finished or with an explicit error, and the pools be whole after.
`PDSERVE_CLUSTER_SOAK_S` (20 by default) sets the traffic's length: a longer run is
`PDSERVE_CLUSTER_SOAK_S=300 pytest tests/ray_cluster/test_cluster_soak.py -s` (it prints the summary)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.bench.soak import ABORTED, ERROR, FINISHED, KINDS, SoakConfig, SoakReport, run_soak
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.serving.cluster_service import ClusterService
from cluster.serving.http.gateway import HttpServer, build_app
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_engine
from tests.ray_cluster.conftest import wait_for
from tests.ray_cluster.test_ray_cluster import router_entries

pytestmark = pytest.mark.usefixtures("ray_session")
SOAK_S = float(os.environ.get("PDSERVE_CLUSTER_SOAK_S", "12"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


async def soak_with_faults(cluster: Cluster, redis: Any, duration_s: float, seed: int = 1) -> SoakReport:
    """The soak through a gateway on `cluster`; a third of the way in the first decode worker's process
    is killed (Ray restarts it), two thirds in Redis is killed and, a second later, restarted empty."""
    import ray

    http = HttpServer(build_app(ClusterService(cluster), api_key=""), "127.0.0.1", 0)
    await http.start()
    try:
        soak = asyncio.create_task(run_soak(http.url, SoakConfig(duration_s=duration_s, seed=seed, concurrency=10)))
        await asyncio.sleep(duration_s / 3)
        ray.kill(cluster.decode[0], no_restart=False)
        await asyncio.sleep(duration_s / 3)
        redis.stop()
        await asyncio.sleep(1.0)
        redis.start()
        return await asyncio.wait_for(soak, duration_s + 300)
    finally:
        await http.stop()


def pools_whole(cluster: Cluster) -> bool:
    import ray

    try:
        states = ray.get([w.pool_state.remote() for w in cluster.prefill + cluster.decode], timeout=30)
    except Exception:  # a worker still restarting
        return False
    return all(free == total for free, total in states)


@pytest.mark.parametrize("decode_workers", [2, 1])
def test_the_soak_through_a_worker_crash_and_a_redis_restart_accounts_for_every_request(
        checkpoint: Path, dedicated_redis: Any, decode_workers: int) -> None:
    """With 2 decode workers the killed one's requests resume on the other; with 1 (the default
    shape) they wait for Ray to restart it, and none fails."""
    import ray

    engine_config = fp32_engine(checkpoint, block_size=4, num_blocks=256, max_num_seqs=8)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1),
                           decode=PoolConfig(replicas=decode_workers, num_cpus=0.1), engine=engine_config,
                           redis_url=dedicated_redis.url)
    cluster = Cluster(config).start()
    try:
        report = asyncio.run(soak_with_faults(cluster, dedicated_redis, SOAK_S))
        summary = report.summary()
        print(json.dumps(summary, indent=1))  # with -s
        assert report.unexpected() == [], summary["unexpected"]
        outcomes = summary["by_outcome"]
        assert outcomes[FINISHED] and outcomes[ABORTED] and outcomes[ERROR]  # errors: the invalid kinds
        assert all(summary["by_kind"][kind].get(FINISHED) or kind in ("invalid", "cancel", "disconnect")
                   for kind in KINDS)
        assert set(summary["errors_by_status"]) <= {"400", "404", "429", "503", "200"}  # 200: an error event
        deadline = time.monotonic() + 60
        while not pools_whole(cluster):
            assert time.monotonic() < deadline, "blocks still held after the soak"
            time.sleep(0.5)
        # The killed worker is back in service (the router may have seen it dead, or only restarting).
        assert ray.get(cluster.decode[0].load.remote(), timeout=60).worker_id == "decode-0"
        # The router takes it back at its next load poll (every 0.5 s).
        wait_for(lambda: "decode-0" in ray.get(cluster.router.live_workers.remote(), timeout=30),
                 "the router never took the restarted worker back", within_s=30)
        deadline = time.monotonic() + 10  # nothing held for requests (their last events may be on the way)
        while left := ray.get(cluster.router.__ray_call__.remote(router_entries), timeout=30):
            assert time.monotonic() < deadline, left
            time.sleep(0.2)
    finally:
        cluster.stop()
