"""The engine thread's OpenMP team must be the process's only one: with another thread's team alive,
libgomp stops spinning at its barriers and every op sleeps and wakes its threads, which slows every
decode step (docs/performance.md). Counted in the engine thread's voluntary context
switches per step (not in seconds), in a fresh process served the way `pdserve serve --local` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.own_thread import in_own_thread

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, json, sys
from cluster.common.sampling_params import SamplingParams
from cluster.serving.local_service import LocalService
from tests.helpers import fp32_engine

def switches(tid):
    with open(f"/proc/self/task/{tid}/status") as status:
        return int(next(line for line in status if line.startswith("voluntary_ctxt_switches")).split()[1])

async def main():
    service = await asyncio.to_thread(LocalService.from_config, fp32_engine(sys.argv[1], num_blocks=256))
    await service.start()
    worker = service.worker
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    async def one(index):
        return [e async for e in service.generate([3 + (index * 7 + i) % 300 for i in range(16)], params, f"r{index}")]
    before = switches(worker.thread.native_id)
    await asyncio.gather(*(one(index) for index in range(16)))
    after = switches(worker.thread.native_id)
    await service.stop()
    print(json.dumps({"switches": after - before}))

asyncio.run(main())
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: a single OpenMP thread has no team to wait for")
def test_the_engine_threads_openmp_team_spins_alone(tmp_path: Path) -> None:
    # Wide enough that its matmuls run as OpenMP parallel regions on 2 threads.
    checkpoint = build_tiny_llama_checkpoint(tmp_path / "wide", hidden=1024, heads=8, kv_heads=4)
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(checkpoint)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    switches = json.loads(result.stdout.strip().splitlines()[-1])["switches"]
    # 16 requests x 24 tokens: ~25 steps of ~2 layers' ops; a throttled team sleeps at every op's barrier.
    assert switches < 200, f"the engine thread slept {switches} times in ~25 steps: its OpenMP team is not alone"


def test_in_own_thread_returns_and_raises_as_the_function() -> None:
    assert in_own_thread(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        in_own_thread(lambda: 1 // 0)
