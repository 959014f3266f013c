"""A host whose GPUs Ray sees but torch cannot use (a CPU build of torch, an NVIDIA driver too old for
its CUDA): `--device auto` says so loudly and reserves none of them, and a worker Ray gives GPUs anyway
(a pool asking for them) refuses to start instead of holding them while it runs on the CPU.

Its own Ray, in a child process, started with GPUs declared to it (`ray.init(num_gpus=2)`): the Ray of
the test session has none, and a process holds one Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.weights.synthetic import build_tiny_llama_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import asyncio, json, logging, sys, tempfile
import ray
from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster, shutdown_ray
from tests.helpers import fp32_engine

logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
ray.init(address="local", num_gpus=2, num_cpus=2, include_dashboard=False, log_to_driver=False,
         _temp_dir=tempfile.mkdtemp(prefix="pdserve-ray-"))
engine = fp32_engine(sys.argv[1], block_size=4, num_blocks=64)  # device "auto"
result = {"engine_device": engine.model.device}

def pools(**pool):
    return dict(prefill=PoolConfig(num_cpus=0.1, **pool), decode=PoolConfig(num_cpus=0.1, **pool))

async def tokens(cluster):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    return [t async for event in cluster.generate([1, 2, 3, 4, 5], params) for t in event.token_ids]

cluster = Cluster(ClusterConfig(engine=engine, **pools())).start()
try:
    result["tokens"] = asyncio.run(tokens(cluster))
    result["gpus_free_while_serving"] = ray.available_resources().get("GPU", 0)
finally:
    cluster.stop()
try:  # a pool that asks for GPUs itself
    Cluster(ClusterConfig(engine=engine, **pools(num_gpus=0.5))).start().stop()
    result["asked_for"] = "started"
except Exception as error:
    result["asked_for"] = str(error)
print(json.dumps(result))
shutdown_ray()
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_auto_reserves_no_gpu_torch_cannot_use_and_a_worker_given_one_refuses(checkpoint: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("torch here can use a GPU")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(checkpoint)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["engine_device"] == "auto"
    assert len(result["tokens"]) == 4  # served, on the CPU
    assert result["gpus_free_while_serving"] == 2  # nothing reserved
    assert "Ray sees 2 GPU(s) on this host, but torch" in done.stderr
    assert "CPU-only build" in done.stderr or "finds no usable GPU" in done.stderr
    assert "holds Ray GPU(s)" in result["asked_for"] and "for device 'auto'" in result["asked_for"], result
