"""The operator port (`pdserve serve --metrics-port`): /metrics, the probes with their reasons and
/v1/workers on a port of their own, none of it on the API port; and a scrape's fan-out to the
workers made at most once per `FAN_OUT_S`, however often the endpoints are asked."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.observability.metrics import ClusterMetrics
from cluster.serving.http.gateway import build_app
from cluster.serving.local_service import LocalService
from cluster.serving.metered_service import MeteredService
from cluster.serving.process import FAN_OUT_S, add_metrics_route, add_status_route, route_operator_endpoints
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.worker.test_warm_up import break_forward, engine_of

START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def client_of(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gateway")


def test_with_an_operator_port_the_api_port_serves_no_metrics_and_keeps_reasons_to_itself(checkpoint: Path) -> None:
    """A worker whose warm-up failed: the operator port says why, the API port only that it is not ready."""

    async def main() -> dict[str, httpx.Response]:
        engine = engine_of(checkpoint)
        break_forward(engine)
        service = await LocalService(engine).start()
        try:
            metrics = ClusterMetrics(service.model_name)
            metered = MeteredService(service, metrics.requests)
            api = build_app(metered, api_key="")
            operator = route_operator_endpoints(api, metrics, metered, separate=True)
            assert operator is not None
            async with client_of(api) as public, client_of(operator) as private:
                return {"api /metrics": await public.get("/metrics"), "api /ready": await public.get("/ready"),
                        "api /health": await public.get("/health"), "api /v1/workers": await public.get("/v1/workers"),
                        "api /v1/models": await public.get("/v1/models"),
                        "operator /metrics": await private.get("/metrics"),
                        "operator /ready": await private.get("/ready"),
                        "operator /health": await private.get("/health"),
                        "operator /v1/workers": await private.get("/v1/workers")}
        finally:
            await service.stop()

    answers = asyncio.run(main())
    assert answers["api /metrics"].status_code == 404
    assert answers["api /v1/workers"].status_code == 404
    assert answers["api /ready"].status_code == 503
    assert answers["api /ready"].json() == {"status": "not ready"}, answers["api /ready"].text  # no internal error text
    assert answers["api /health"].status_code == 200 and answers["api /v1/models"].status_code == 200
    assert answers["operator /metrics"].status_code == 200 and "vllm:num_requests_running" in answers[
        "operator /metrics"].text
    assert answers["operator /ready"].status_code == 503 and "warm-up failed" in answers["operator /ready"].json()[
        "reason"]
    assert answers["operator /health"].status_code == 200
    assert "warm-up failed" in answers["operator /v1/workers"].json()["problem"]


def test_without_an_operator_port_the_api_port_serves_everything_as_vllm_does(checkpoint: Path) -> None:
    async def main() -> tuple[int, int]:
        service = await LocalService(engine_of(checkpoint)).start()
        try:
            metrics = ClusterMetrics(service.model_name)
            metered = MeteredService(service, metrics.requests)
            api = build_app(metered, api_key="")
            assert route_operator_endpoints(api, metrics, metered, separate=False) is None
            async with client_of(api) as public:
                return (await public.get("/metrics")).status_code, (await public.get("/v1/workers")).status_code
        finally:
            await service.stop()

    assert asyncio.run(main()) == (200, 200)


class Counted:
    """Passes calls through to `call`, counting them: how many rounds of worker calls a scrape made."""

    def __init__(self, call: Callable[[], Awaitable[Any]]) -> None:
        self.call, self.calls = call, 0

    async def __call__(self) -> Any:
        self.calls += 1
        return await self.call()


def test_scrapes_within_the_interval_make_one_round_of_worker_calls(checkpoint: Path) -> None:
    async def main() -> tuple[list[int], list[int], list[int]]:
        service = await LocalService(engine_of(checkpoint)).start()
        try:
            metrics = ClusterMetrics(service.model_name)
            workers: Counted = Counted(service.workers)
            service.workers = workers  # type: ignore[method-assign]  # counted, still the engine's real answer
            routers = Counted(_no_counters)
            metrics.sources.append(routers)
            app = build_app(service, api_key="")
            add_metrics_route(app, metrics, service)
            add_status_route(app, service)
            async with client_of(app) as client:
                started = time.monotonic()
                scrapes = [await client.get("/metrics") for _ in range(10)]
                scrapes += await asyncio.gather(*(client.get("/metrics") for _ in range(10)))
                statuses = [await client.get("/v1/workers") for _ in range(10)]
                assert time.monotonic() - started < FAN_OUT_S, "too slow to test the interval here"
                assert all(r.status_code == 200 and "pdserve:" in r.text for r in scrapes)
                assert all(r.json()["workers"][0]["worker_id"] == "local-0" for r in statuses)
                within = [workers.calls, routers.calls]
                await asyncio.sleep(FAN_OUT_S + 0.1)
                await client.get("/metrics")
                await client.get("/v1/workers")
                later = [workers.calls, routers.calls]
                return within, later, [len(scrapes), len(statuses)]
        finally:
            await service.stop()

    within, later, asked = asyncio.run(main())
    assert asked == [20, 10]
    assert within == [2, 1]  # one round for /metrics (workers and routers), one for /v1/workers
    assert later == [4, 2]  # past the interval: fresh again


async def _no_counters() -> dict[str, Any]:
    return {}


def test_serve_with_a_metrics_port_scrapes_there_and_not_on_the_api_port(checkpoint: Path) -> None:
    command = [sys.executable, "-m", "cluster.cli", "serve", "--local", "--model", str(checkpoint), "--host",
               "127.0.0.1", "--port", "0", "--grpc-port", "-1", "--metrics-port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PDSERVE_API_KEY": "", "COLUMNS": "400"})  # one line
    try:
        api, operator = _printed_urls(process)
        deadline = time.monotonic() + START_TIMEOUT_S
        while httpx.get(operator + "/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.2)
        assert httpx.get(api + "/ready", timeout=10).status_code == 200
        assert httpx.get(api + "/metrics", timeout=10).status_code == 404
        assert "vllm:num_requests_running" in httpx.get(operator + "/metrics", timeout=10).text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def _printed_urls(process: subprocess.Popen[str]) -> tuple[str, str]:
    """The API's and the operator port's URLs, as `serve` prints them once listening."""
    assert process.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        found = re.search(r"HTTP on (http://\S+?),.* metrics and probes on (http://\S+?);", line)
        if found:
            return found.group(1), found.group(2)
        if not line and process.poll() is not None:
            break
    pytest.fail(f"the server did not start (exit code {process.poll()})")

