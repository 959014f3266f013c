"""/metrics after real requests: the counts and histograms add up (vLLM's names, one scrape)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.engine.config import CacheConfig, EngineConfig
from cluster.observability.metrics import ClusterMetrics
from cluster.serving.http.gateway import HttpServer, build_app
from cluster.serving.local_service import LocalService
from cluster.serving.metered_service import MeteredService
from cluster.serving.process import add_metrics_route
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

PROMPTS = [[5, 17, 33, 9], [200, 201, 202, 7, 7, 7], [44] * 9]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a scrape."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scraped: dict, name: str, **labels: str) -> float:
    matching = [v for (n, ls), v in scraped.items() if n == name and all((k, v) in ls for k, v in labels.items())]
    assert matching, f"no sample {name} {labels}"
    return sum(matching)


def test_metrics_add_up_after_real_requests(checkpoint: Path) -> None:
    async def main() -> str:
        service = await LocalService.from_config(EngineConfig(model=fp32_model(checkpoint),
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

    scraped = samples(asyncio.run(main()))
    requests = len(PROMPTS)
    assert value(scraped, "vllm:request_success_total", finished_reason="length") == requests
    assert value(scraped, "vllm:generation_tokens_total") == requests * MAX_TOKENS
    assert value(scraped, "vllm:prompt_tokens_total") == sum(len(p) for p in PROMPTS)
    assert value(scraped, "vllm:time_to_first_token_seconds_count") == requests
    assert value(scraped, "vllm:inter_token_latency_seconds_count") == requests * (MAX_TOKENS - 1)
    assert value(scraped, "vllm:e2e_request_latency_seconds_count") == requests
    ttft_sum = value(scraped, "vllm:time_to_first_token_seconds_sum")
    assert 0 < ttft_sum <= value(scraped, "vllm:e2e_request_latency_seconds_sum")
    assert value(scraped, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == requests
    # The worker's own numbers, labelled by worker and role: idle and whole after the requests.
    assert value(scraped, "vllm:num_requests_running", worker="local-0", role="colocated") == 0
    assert value(scraped, "vllm:kv_cache_usage_perc", worker="local-0") == 0
    assert value(scraped, "pdserve:kv_cache_free_blocks", worker="local-0") == 64
    assert value(scraped, "vllm:prefix_cache_queries_total", worker="local-0") >= sum(len(p) for p in PROMPTS)
    assert value(scraped, "pdserve:workers", role="colocated") == 1
