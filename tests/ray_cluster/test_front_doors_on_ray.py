"""The front doors on the disaggregated Ray cluster: the HTTP gateway and the gRPC server in front of
`ClusterService` give the engine's own tokens, and a client that leaves frees blocks on every worker."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from cluster.common.events import TokenEvent
from cluster.common.sampling_params import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.observability.metrics import ClusterMetrics
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.serving.cluster_service import ClusterService
from cluster.serving.metered_service import MeteredService
from cluster.serving.process import add_metrics_route
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_engine_outputs import PROMPTS
from tests.helpers import fp32_engine
from tests.observability.test_metrics import samples, value
from tests.ray_cluster.conftest import pace_steps

pytestmark = pytest.mark.usefixtures("ray_session")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(checkpoint: Path) -> Iterator[Cluster]:
    engine_config = fp32_engine(checkpoint, block_size=4, num_blocks=128)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config)
    started = Cluster(config).start()
    yield started
    started.stop()


def pools_whole(cluster: Cluster) -> bool:
    import ray

    return all(free == total for free, total in
               ray.get([w.pool_state.remote() for w in cluster.prefill + cluster.decode], timeout=30))


def test_gateway_and_grpc_on_the_cluster(cluster: Cluster, checkpoint: Path) -> None:
    from cluster.client import AsyncClient
    from cluster.serving.grpc.server import GrpcServer
    from cluster.serving.http.gateway import HttpServer, build_app

    engine = LLMEngine(fp32_engine(checkpoint, block_size=4, num_blocks=128))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    expected = [output.text for output in engine.generate(PROMPTS[:3], greedy)]

    async def main() -> None:
        metrics = ClusterMetrics(cluster.model_name)

        async def router_decisions() -> dict[str, dict[str, int]]:
            return {"decisions": await cluster.router.stats.remote()}

        metrics.sources.append(router_decisions)
        service = MeteredService(ClusterService(cluster), metrics.requests)
        app = build_app(service, api_key="")
        add_metrics_route(app, metrics, service)
        http = HttpServer(app, "127.0.0.1", 0)
        grpc = GrpcServer(service, "127.0.0.1", 0, api_key="")
        await http.start()
        await grpc.start()
        try:
            client = openai.AsyncOpenAI(base_url=http.url + "/v1", api_key="unused")
            answers = await asyncio.gather(*(client.completions.create(
                model=service.model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True}) for prompt in PROMPTS[:3]))
            assert [answer.choices[0].text for answer in answers] == expected
            assert [answer.usage.prompt_tokens for answer in answers] == [len(p) for p in PROMPTS[:3]]
            async with AsyncClient(f"127.0.0.1:{grpc.port}") as sdk:
                result = await sdk.complete(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            assert result.text == expected[0]
            await check_metrics(http.url)
            await leave_mid_stream(http.url, service.model_name)
            deadline = time.monotonic() + 20
            while not pools_whole(cluster):
                assert time.monotonic() < deadline, "blocks still held after the client left"
                await asyncio.sleep(0.2)
        finally:
            await grpc.stop(1)
            await http.stop()

    asyncio.run(main())


async def check_metrics(url: str) -> None:
    """One scrape shows the cluster: requests at the gateway, transfers on the prefill worker, the router."""
    async with httpx.AsyncClient(timeout=30) as http:
        scraped = samples((await http.get(url + "/metrics")).text)
    assert value(scraped, "vllm:request_success_total", finished_reason="length") == 4  # 3 HTTP + 1 gRPC
    assert value(scraped, "vllm:generation_tokens_total") == 4 * MAX_TOKENS
    assert value(scraped, "pdserve:kv_transfers_total", role="prefill") == 4
    assert value(scraped, "pdserve:kv_transfer_bytes_total", role="prefill") > 0
    assert value(scraped, "pdserve:kv_transfer_failures_total", role="prefill") == 0
    assert value(scraped, "vllm:num_requests_running", role="decode") == 0
    assert value(scraped, "pdserve:router_decisions_total", decision="transfer_failed") == 0
    assert value(scraped, "pdserve:workers", role="prefill") == 1


async def leave_mid_stream(url: str, model: str) -> None:
    body = {"model": model, "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as http, http.stream("POST", url + "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                break  # the first token came: leave


def test_clients_cannot_reach_each_others_requests_through_ids(cluster: Cluster) -> None:
    """On the cluster path: two clients sending the same X-Request-Id get two requests (the second is
    not refused, the first is not aborted), and a prompt of token ids outside the vocabulary (2**64
    among them, which the router's prefix hashes cannot take) is a 400 that leaves nothing behind for
    a later request with that id to trip on."""
    from cluster.serving.http.gateway import HttpServer, build_app

    async def main() -> None:
        service = ClusterService(cluster)
        http = HttpServer(build_app(service, api_key=""), "127.0.0.1", 0)
        await http.start()
        headers = {"X-Request-Id": "shared-id"}
        long_body = {"prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            async with httpx.AsyncClient(base_url=http.url, timeout=60) as client:
                async with client.stream("POST", "/v1/completions", json=long_body, headers=headers) as first:
                    lines = first.aiter_lines()
                    async for line in lines:
                        if line.startswith("data: "):
                            break
                    second = await client.post("/v1/completions", headers=headers,
                                               json={"prompt": PROMPTS[1], "max_tokens": 3})
                    assert second.status_code == 200, second.text
                    events = [json.loads(line.removeprefix("data: ")) async for line in lines
                              if line.startswith("data: ") and line != "data: [DONE]"]
                assert events[-1]["choices"][0]["finish_reason"] == "length"
                for hostile in ([5, 10**6], [-1], [2**64]):
                    poisoned = await client.post("/v1/completions", headers={"X-Request-Id": "poison"},
                                                 json={"prompt": hostile, "max_tokens": 3})
                    assert poisoned.status_code == 400, poisoned.text
                    assert "vocabulary" in poisoned.json()["error"]["message"]
                again = await client.post("/v1/completions", headers={"X-Request-Id": "poison"},
                                          json={"prompt": PROMPTS[2], "max_tokens": 3})
                assert again.status_code == 200, again.text
            deadline = time.monotonic() + 20
            while not pools_whole(cluster):
                assert time.monotonic() < deadline, "blocks still held"
                await asyncio.sleep(0.2)
        finally:
            await http.stop()

    asyncio.run(main())


def test_a_client_that_stops_reading_is_cut_off_on_the_cluster_path(checkpoint: Path) -> None:
    """Through the Ray cluster: a streaming client that reads nothing is disconnected after the write
    timeout and its request aborted on the workers long before its answer would have ended, while
    the gateway held a bounded number of events (Ray's stream backpressure holds the router and the
    worker, whose output stream merges what the engine makes meanwhile)."""
    import socket

    import ray

    from cluster.serving.http.gateway import EVENTS_AHEAD, HttpServer, build_app

    engine_config = fp32_engine(checkpoint, block_size=16, num_blocks=256)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()
    decode = cluster.decode[0]
    max_tokens = 480  # at least 4.8 s of paced steps
    body = json.dumps({"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "n": 6, "logprobs": 20,
                       "temperature": 1.0, "stream": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    async def main() -> tuple[int, int, bytes]:
        app = build_app(ClusterService(cluster), api_key="", stream_write_timeout_s=1.0)
        http = HttpServer(app, "127.0.0.1", 0)
        await http.start()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        held = 0
        try:
            await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", http.port))
            await asyncio.get_running_loop().sock_sendall(client, request)
            deadline = time.monotonic() + 60
            while True:
                runs = list(app.state.gateway.runs)
                held = max([held, *(run.events_held() for run in runs)])
                if not runs and held:
                    break  # the run was closed: the client was cut off
                assert time.monotonic() < deadline, "the client that reads nothing was never cut off"
                await asyncio.sleep(0.02)
            while not pools_whole(cluster):
                assert time.monotonic() < deadline, "the aborted request still holds blocks"
                await asyncio.sleep(0.1)
            steps = ray.get(decode.__ray_call__.remote(lambda actor: actor.steps), timeout=30)
            received = b""
            while chunk := await asyncio.wait_for(asyncio.get_running_loop().sock_recv(client, 1 << 16), 10):
                received += chunk
            return steps, held, received
        finally:
            client.close()
            await http.stop()

    try:
        ray.get(decode.__ray_call__.remote(pace_steps(0.01)), timeout=30)
        steps, held, received = asyncio.run(main())
        assert steps < max_tokens, "the workers generated the whole answer for a client that read none of it"
        assert held <= EVENTS_AHEAD + 2 * 6
        assert b"HTTP/1.1 200" in received and b"[DONE]" not in received
    finally:
        cluster.stop()


def test_prompt_logprobs_come_once_from_the_prefill_worker_as_the_engine_alones(cluster: Cluster,
                                                                               checkpoint: Path) -> None:
    """The prefill worker computes them; they travel with its first token through the router, and the
    decode worker's restated first token brings none (the client sees them once)."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2)
    engine = LLMEngine(fp32_engine(checkpoint, block_size=4, num_blocks=128))
    engine.add_request(PROMPTS[3], params)
    alone = engine.step()[0].prompt_logprobs
    assert alone is not None

    async def events() -> list[TokenEvent]:
        return [event async for event in ClusterService(cluster).generate(PROMPTS[3], params, "prompt-logprobs")]

    received = asyncio.run(events())
    with_them = [event for event in received if event.prompt_logprobs is not None]
    assert len(with_them) == 1 and with_them[0].index == 0 and received[-1].finished
    (clustered,) = [event.prompt_logprobs for event in with_them]
    assert clustered[0] is None and len(clustered) == len(alone) == len(PROMPTS[3])
    pairs = list(zip(clustered[1:], alone[1:], strict=True))
    assert all(ours is not None and theirs is not None and ours.token_id == theirs.token_id
               and ours.logprob == pytest.approx(theirs.logprob, abs=1e-5) and ours.rank == theirs.rank
               and [t for t, _ in ours.top] == [t for t, _ in theirs.top] for ours, theirs in pairs)


def test_grpc_reports_the_prompt_tokens_the_prefill_worker_found_cached(cluster: Cluster) -> None:
    """The prefill worker knows the cached prompt tokens and the decode worker's events do not: gRPC's
    usage must carry the prefill worker's count, as HTTP's does."""
    from cluster.client import AsyncClient
    from cluster.serving.grpc.server import GrpcServer
    from cluster.serving.http.gateway import build_app

    prompt = "A prompt sent twice is found in the prefill worker's prefix cache the second time."

    async def main() -> None:
        service = ClusterService(cluster)
        grpc = GrpcServer(service, "127.0.0.1", 0, api_key="")
        await grpc.start()
        try:
            async with AsyncClient(f"127.0.0.1:{grpc.port}") as sdk:
                first = await sdk.complete(prompt, max_tokens=2, temperature=0)
                second = await sdk.complete(prompt, max_tokens=2, temperature=0)
            transport = httpx.ASGITransport(build_app(service, api_key=""))
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=30) as http:
                answer = (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                                                   "temperature": 0})).json()
        finally:
            await grpc.stop(1)
        assert first.usage.prompt_tokens == second.usage.prompt_tokens > 40
        assert second.usage.cached_tokens > 0
        assert second.usage.cached_tokens == answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    asyncio.run(main())


def test_a_decode_worker_alone_computes_on_every_core_of_its_host(cluster: Cluster) -> None:
    """Threads follow the load (cluster/worker/node_cores.py): Ray's share of a 0.1-CPU worker is one
    thread, but while the prefill worker has no prompt the decode worker's steps take its core too."""
    import ray

    from cluster.worker.node_cores import host_cores

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def run() -> list[TokenEvent]:
        return [event async for event in ClusterService(cluster).generate(PROMPTS[0], params, "threads")]

    assert sum(len(event.token_ids) for event in asyncio.run(run())) == 24
    load = ray.get(cluster.decode[0].load.remote(), timeout=30)
    assert load.threads == host_cores(ray.cluster_resources()["CPU"])


def test_a_steps_tokens_cross_each_hop_in_one_message(cluster: Cluster) -> None:
    """8 requests decoding together: the decode worker sends their tokens to the router, and the router
    to the gateway, a step's worth per message on one channel (`cluster.ray_cluster.channels`), not
    one Ray stream item per request per step (each item costs the router and the gateway CPU).
    So neither sends many more messages than the decode worker runs steps, its requests' admissions
    and (the router) their first tokens from the prefill worker."""
    import ray

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    decode = cluster.decode[0]
    actors = [decode, cluster.routers[0]]

    def totals() -> list[tuple[int, int]]:
        return ray.get([actor.channel_totals.remote() for actor in actors], timeout=30)

    async def one(index: int) -> int:
        events = [event async for event in ClusterService(cluster).generate(PROMPTS[index % len(PROMPTS)], params,
                                                                            f"batched-{index}")]
        return sum(len(event.token_ids) for event in events)

    async def run() -> list[int]:
        return await asyncio.gather(*(one(index) for index in range(8)))

    ray.get(decode.__ray_call__.remote(pace_steps(0.0)), timeout=30)  # counts the steps, no pause
    try:
        before = totals()
        assert asyncio.run(run()) == [24] * 8
        after = totals()
        steps = ray.get(decode.__ray_call__.remote(lambda actor: actor.steps), timeout=30)
    finally:
        ray.get(decode.__ray_call__.remote(lambda actor: actor.worker.engine.__dict__.pop("step", None) and None),
                timeout=30)
    (decode_messages, decode_items), (router_messages, router_items) = (
        (messages - messages_before, items - items_before)
        for (messages_before, items_before), (messages, items) in zip(before, after, strict=True))
    assert decode_items >= 8  # every request's tokens went out on the channel (joined when the reader lagged)
    # Beyond one message per step: each request's admission once its KV landed is delivered on its own
    # (8), and the router relays each first token from the prefill worker (8).
    assert decode_messages <= steps + 8 + 2, (decode_messages, decode_items, steps)
    assert router_messages <= steps + 8 + 8 + 2, (router_messages, router_items, steps)
