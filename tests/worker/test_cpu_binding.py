"""Cores kept for the front door (`reserved_cpus`): the engine thread and the OpenMP threads it
starts compute on the engines' cores, every other thread stays on the front door's. Checked on the
threads' affinity in a fresh process served the way `pdserve serve --local` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.ray_cluster.config import load_cluster_config
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.cpu_binding import parse_cpu_list, split_cpus

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, json, os, sys, threading
from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig
from cluster.serving.local_service import LocalService
from cluster.serving.process import ServiceLauncher
from cluster.worker.cpu_binding import bind_process, parse_cpu_list
from tests.helpers import fp32_engine

def allowed(tid):
    with open(f"/proc/self/task/{tid}/status") as status:
        return parse_cpu_list(next(line for line in status if line.startswith("Cpus_allowed_list")).split()[1])

async def main():
    front, engines = frozenset(json.loads(sys.argv[2])), frozenset(json.loads(sys.argv[3]))
    if sys.argv[4] == "launcher":  # as `pdserve serve --local --reserved-cpus 1` starts it
        config = ClusterConfig(engine=fp32_engine(sys.argv[1], num_blocks=256), reserved_cpus=1)
        service = await ServiceLauncher(config, local=True).start()
    else:  # bound by hand: any split
        bind_process(front)
        service = await asyncio.to_thread(LocalService.from_config, fp32_engine(sys.argv[1], num_blocks=256), engines)
        await service.start()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    async def one(index):
        return [e async for e in service.generate([3 + (index * 7 + i) % 300 for i in range(32)], params, f"r{index}")]
    await asyncio.gather(*(one(index) for index in range(8)))
    worker = service.worker
    on_engine_cpus = sum(allowed(int(tid)) == sorted(engines) for tid in os.listdir("/proc/self/task"))
    report = {"engine": allowed(worker.thread.native_id), "loop": allowed(threading.get_native_id()),
              "on_engine_cpus": on_engine_cpus, "torch_threads": worker.threads}
    await service.stop()
    print(json.dumps(report))

asyncio.run(main())
"""


def run_bound(checkpoint: Path, front: list[int], engines: list[int], how: str = "by hand") -> dict[str, object]:
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    command = [sys.executable, "-c", SCRIPT, str(checkpoint), json.dumps(front), json.dumps(engines), how]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Wide enough that its matmuls run as OpenMP parallel regions on 2 threads.
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("wide"), hidden=1024, heads=8, kv_heads=4)


CPUS = sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(len(CPUS) < 2, reason="one core: nothing to keep apart")
def test_the_engine_computes_on_its_cores_and_the_front_door_on_the_others(wide_checkpoint: Path) -> None:
    split = split_cpus(1, CPUS)
    assert split is not None
    report = run_bound(wide_checkpoint, sorted(split.front_door), sorted(split.engines), "launcher")
    assert report["engine"] == sorted(split.engines)
    assert report["loop"] == sorted(split.front_door)
    # One torch thread per core it may use (torch's own default would count the host's cores).
    assert report["torch_threads"] == len(split.engines)


@pytest.mark.skipif(len(CPUS) < 2, reason="one core: a single OpenMP thread starts no team")
def test_the_engine_threads_openmp_team_takes_the_engines_cores(wide_checkpoint: Path) -> None:
    # The front door on one core, the engine on two (here: overlapping, as a 2-core host allows): its
    # OpenMP thread, started by its first parallel op, must inherit the engine's cores, not the process's.
    report = run_bound(wide_checkpoint, CPUS[:1], CPUS[:2])
    assert report["torch_threads"] == 2
    assert report["on_engine_cpus"] >= 2, report  # the engine thread and its OpenMP thread


def test_a_reservation_leaves_the_engines_a_core_and_is_refused_otherwise() -> None:
    assert split_cpus(0, [0, 1]) is None
    split = split_cpus(2, [3, 0, 1, 2])
    assert split is not None and split.front_door == {0, 1} and split.engines == {2, 3}
    with pytest.raises(ValueError, match="reserved_cpus"):
        split_cpus(2, [0, 1])
    with pytest.raises(ValueError, match="reserved_cpus"):
        load_cluster_config(None, {"reserved_cpus": -1})
    assert parse_cpu_list("0-2,5,7-8\n") == [0, 1, 2, 5, 7, 8]
