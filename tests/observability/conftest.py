"""One live scrape for the metrics and dashboard tests: real requests through the HTTP gateway to
one in-process engine, then GET /metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
from cluster.observability.metrics import ClusterMetrics
from cluster.serving.http.gateway import HttpServer, build_app
from cluster.serving.local_service import LocalService
from cluster.serving.metered_service import MeteredService
from cluster.serving.process import add_metrics_route
from cluster.weights.synthetic import build_tiny_llama_checkpoint

PROMPTS = [[5, 17, 33, 9], [200, 201, 202, 7, 7, 7], [44] * 9]
MAX_TOKENS = 5


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def live_scrape(checkpoint: Path) -> str:
    """/metrics after `PROMPTS` ran (the first streamed) and one request was refused."""

    async def main() -> str:
        service = await LocalService.from_config(EngineConfig(model=ModelConfig(model=str(checkpoint)),
                                                              cache=CacheConfig(block_size=4, num_blocks=64))).start()
        metrics = ClusterMetrics(service.model_name)
        metered = MeteredService(service, metrics.requests)
        app = build_app(metered, api_key="")
        add_metrics_route(app, metrics, metered)
        server = HttpServer(app, "127.0.0.1", 0)
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                for index, prompt in enumerate(PROMPTS):
                    body = {"model": service.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                            "temperature": 0, "ignore_eos": True, "stream": index == 0}
                    assert (await client.post("/v1/completions", json=body)).status_code == 200
                bad = await client.post("/v1/completions", json={"model": service.model_name, "prompt": [1] * 999})
                assert bad.status_code == 400  # refused before it ran: counted nowhere
                reply = await client.get("/metrics")
                assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
                return reply.text
        finally:
            await server.stop()
            await service.stop()

    return asyncio.run(main())
