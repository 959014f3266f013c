"""Ready means it works: every worker runs a request through prefill and decode before it serves, and
one whose warm-up fails keeps the service unready, saying why."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.serving.cluster_service import ClusterService
from cluster.serving.http.gateway import build_app
from cluster.serving.local_service import LocalService
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.worker import Worker
from tests.helpers import fp32_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def engine_of(checkpoint: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=fp32_model(checkpoint), cache=CacheConfig(block_size=2,
                                                                                              num_blocks=32)))


def break_forward(engine: LLMEngine) -> None:
    """Plant a fault the first forward pass meets: a layer whose weight has the wrong shape."""
    layer = engine.runner.model.model.layers[0].self_attn.qkv_proj
    layer.weight = torch.nn.Parameter(torch.zeros(3, 5))


def test_warm_up_leaves_nothing_behind(checkpoint: Path) -> None:
    engine = engine_of(checkpoint)
    assert engine.warm_up() > 0  # the timed prefill's tokens per second: the router's first estimate
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_blocks  # nothing held, nothing cached (block_size 2 filled one)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert not engine.detokenizers


def test_a_worker_warms_up_before_it_serves(checkpoint: Path) -> None:
    async def main() -> str:
        worker = Worker("w-0", "colocated", engine_of(checkpoint))
        await worker.start()
        try:
            return (await worker.load()).failure
        finally:
            await worker.stop()

    assert asyncio.run(main()) == ""


def test_a_failed_warm_up_keeps_ready_at_503_with_the_reason(checkpoint: Path) -> None:
    async def main() -> tuple[httpx.Response, str, bool]:
        engine = engine_of(checkpoint)
        break_forward(engine)
        service = await LocalService(engine).start()
        try:
            app = build_app(service, api_key="")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gateway") as client:
                ready = await client.get("/ready")
            return ready, (await service.worker.load()).failure, service.ready
        finally:
            await service.stop()

    ready, failure, is_ready = asyncio.run(main())
    assert not is_ready
    assert failure.startswith("warm-up failed on cpu")
    assert ready.status_code == 503
    assert ready.json()["status"] == "not ready" and "warm-up failed" in ready.json()["reason"]


def test_a_failed_warm_up_leaves_no_request_or_block_behind(checkpoint: Path) -> None:
    engine = engine_of(checkpoint)
    break_forward(engine)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        engine.warm_up()
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


class StartedCluster:
    """What `ClusterService` reads of a started `Cluster`: its routers and its workers' failures."""

    model_name, max_model_len, tokenizer, router = "tiny", 64, None, object()

    def __init__(self, failures: dict[str, str]) -> None:
        self.failures = failures
        self.routers: list[object] = [self.router]
        self.routers_down: dict[int, str] = {}


def test_a_cluster_with_a_failed_worker_is_not_ready_and_names_it() -> None:
    assert ClusterService(StartedCluster({})).ready
    service = ClusterService(StartedCluster({"decode-0": "warm-up failed on cuda:0: boom"}))
    assert not service.ready
    assert service.problem == "decode-0: warm-up failed on cuda:0: boom"


UCX_AT_START = """
import asyncio, sys
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.transfer import ucx
from cluster.worker.worker import Worker
from tests.helpers import fp32_model

async def main():
    engine = LLMEngine(EngineConfig(model=fp32_model(sys.argv[1]), cache=CacheConfig(block_size=2, num_blocks=32)))
    worker = Worker("prefill-0", "prefill", engine, sender=ucx.UCXSender())
    before = ucx._ucxx is not None
    await worker.start()
    try:
        print(before, ucx._ucxx is not None, "ucxx" in sys.modules)
    finally:
        await worker.stop()

asyncio.run(main())
"""


def test_a_prefill_worker_readies_ucx_when_it_starts_not_at_its_first_send(checkpoint: Path) -> None:
    """Importing and initialising ucxx takes about half a second. Left to a prefill worker's first send,
    it would hold the first prompts after every start or restart of the worker that long between their
    first token and the second. The worker readies its sender while it starts (a fresh process:
    nothing imported ucxx before)."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", UCX_AT_START, str(checkpoint)], cwd=root, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["False", "True", "True"], result.stdout
