"""A host's cores shared by its workers: a busy engine gets every core no other busy engine holds."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from cluster.worker.node_cores import NodeCores


def pair(tmp_path: Path, total: int = 2) -> tuple[NodeCores, NodeCores, dict[str, list[int]]]:
    applied: dict[str, list[int]] = {"prefill": [], "decode": []}
    path = tmp_path / "cores.json"
    prefill = NodeCores(total, 1, path, applied["prefill"].append, pid=1)  # pid 1 lives as long as the host
    decode = NodeCores(total, 1, path, applied["decode"].append, pid=os.getpid())
    return prefill, decode, applied


def test_a_decode_worker_alone_takes_the_idle_prefill_workers_core_and_gives_it_back(tmp_path: Path) -> None:
    prefill, decode, applied = pair(tmp_path)
    assert decode.busy() == 2  # the prefill worker has nothing to do: both cores decode
    assert prefill.busy() == 1  # a prompt comes: the prefill worker runs on its own share at once
    assert decode.busy() == 1  # the decode worker's next step leaves it that core
    assert prefill.busy() == 1 and decode.busy() == 1  # both busy: one core each, no oversubscription
    prefill.idle()
    assert decode.busy() == 2
    assert applied == {"prefill": [1], "decode": [2, 1, 2]}  # threads are set only when they change


def test_a_worker_always_runs_on_its_own_share(tmp_path: Path) -> None:
    path = tmp_path / "cores.json"
    big = NodeCores(8, 4, path, lambda threads: None, pid=1)
    small = NodeCores(8, 2, path, lambda threads: None, pid=os.getpid())
    assert big.busy() == 8
    assert small.busy() == 2  # 0 left by the other's claim, but never below its own share
    assert big.busy() == 6
    assert NodeCores(2, 5, path, lambda threads: None).own == 2  # a share is at most the host's cores


def test_the_claim_of_a_dead_worker_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "cores.json"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    dead = NodeCores(2, 1, path, lambda threads: None, pid=int(child.stdout))
    assert dead.busy() == 2  # the process ended without withdrawing its claim
    assert NodeCores(2, 1, path, lambda threads: None, pid=1).busy() == 2


def test_a_file_of_another_format_is_started_over(tmp_path: Path) -> None:
    path = tmp_path / "cores.json"
    path.write_text("[1, 2, 3]")
    assert NodeCores(2, 1, path, lambda threads: None, pid=1).busy() == 2


def test_a_worker_claims_the_cores_while_it_computes_and_withdraws_when_idle(tmp_path: Path) -> None:
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig
    from cluster.engine.llm_engine import LLMEngine
    from cluster.weights.synthetic import build_tiny_llama_checkpoint
    from cluster.worker.worker import Worker
    from tests.helpers import fp32_model

    path, applied = tmp_path / "cores.json", []
    engine = LLMEngine(EngineConfig(model=fp32_model(build_tiny_llama_checkpoint(tmp_path / "tiny")),
                                    cache=CacheConfig(block_size=4, num_blocks=64)))
    worker = Worker("colocated-0", "colocated", engine, cores=NodeCores(2, 1, path, applied.append))
    prefill = NodeCores(2, 1, path, lambda threads: None, pid=1)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def generate(request_id: str) -> int:
        return sum([len(output.new_token_ids) async for output in worker.generate(request_id, [5, 6, 7], params)])

    async def main() -> None:
        await worker.start()
        try:
            assert await generate("alone") == 8
            await asyncio.sleep(0.2)  # idle: its claim is withdrawn
            assert json.loads(path.read_text()) == {}
            prefill.busy()
            assert await generate("beside-a-busy-prefill") == 8
        finally:
            await worker.stop()

    asyncio.run(main())
    assert applied == [2, 1]  # both cores while alone; its own one beside a busy worker


def test_a_decode_worker_holding_only_reservations_claims_no_cores(tmp_path: Path) -> None:
    """A reservation waits for its KV: nothing to compute, so the worker's idle loop (every 50 ms) must
    not claim the host's cores and withdraw the claim each time (a locked file write per loop)."""
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig
    from cluster.engine.llm_engine import LLMEngine
    from cluster.transfer.loopback import LoopbackHub, LoopbackReceiver
    from cluster.weights.synthetic import build_tiny_llama_checkpoint
    from cluster.worker.worker import Worker
    from tests.helpers import fp32_model

    claims: list[int] = []

    class CountedCores(NodeCores):
        def busy(self) -> int:
            claims.append(1)
            return super().busy()

    engine = LLMEngine(EngineConfig(model=fp32_model(build_tiny_llama_checkpoint(tmp_path / "tiny")),
                                    cache=CacheConfig(block_size=4, num_blocks=64)))
    worker = Worker("decode-0", "decode", engine, receiver=LoopbackReceiver(LoopbackHub(), "decode-0"),
                    cores=CountedCores(2, 1, tmp_path / "cores.json", lambda threads: None))

    async def main() -> None:
        await worker.start()
        try:
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            assert await worker.reserve("waiting-for-kv", [5, 6, 7], params, lease_s=30) is not None
            await asyncio.sleep(0.5)  # about ten idle loops
            assert engine.has_unfinished_requests() and claims == []
        finally:
            await worker.stop()

    asyncio.run(main())
