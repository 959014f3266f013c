"""One disaggregated request's trace across the Ray cluster's processes: the gateway (this process),
the router, the prefill and the decode worker each export their own spans over OTLP to a real OTLP
receiver in this process, and together they make one tree."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from cluster.observability import tracing
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from
from cluster.ray_cluster.launcher import Cluster
from cluster.serving.cluster_service import ClusterService
from cluster.serving.http.gateway import HttpServer, build_app
from cluster.weights.synthetic import build_tiny_llama_checkpoint

pytestmark = pytest.mark.usefixtures("ray_session")
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
PROMPT = list(range(3, 40))  # 37 tokens: 3 chunks of at most 16
EXPECTED = {"pdserve.request", "pdserve.route", "pdserve.prefill", "pdserve.queue", "pdserve.prefill_chunk",
            "pdserve.kv_send", "pdserve.kv_receive", "pdserve.decode_admission", "pdserve.decode_stream"}


@dataclass(frozen=True)
class Received:
    service: str  # the exporting process's service.name
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver (what a collector listens with) that keeps the spans in memory."""

    def __init__(self) -> None:
        self.spans: list[Received] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest,  # noqa: N802 (the proto's name)
               context: grpc.ServicerContext) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            service = next(attribute.value.string_value for attribute in resource_spans.resource.attributes
                           if attribute.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                self.spans += [Received(service, span.name, span.trace_id.hex(), span.span_id.hex(),
                                        span.parent_span_id.hex(), {attribute.key: _value(attribute.value)
                                                                    for attribute in span.attributes})
                               for span in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[OtlpReceiver, str]]:
    servicer = OtlpReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, receiver: tuple[OtlpReceiver, str]) -> Iterator[Cluster]:
    checkpoint: Path = build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))
    engine_config = engine_config_from({"model": str(checkpoint), "block_size": 4, "num_blocks": 128,
                                        "max_num_batched_tokens": 16})
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, tracing=tracing.TracingConfig(endpoint=receiver[1]))
    tracing.configure(config.tracing, "pdserve-gateway")  # as `pdserve serve` does in its own process
    started = Cluster(config).start()
    yield started
    started.stop()
    tracing.shutdown()


def test_a_disaggregated_request_is_one_trace_across_every_process(
        cluster: Cluster, receiver: tuple[OtlpReceiver, str]) -> None:
    async def main() -> httpx.Response:
        http = HttpServer(build_app(ClusterService(cluster), api_key=""), "127.0.0.1", 0)
        await http.start()
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                return await client.post(http.url + "/v1/completions",
                                         headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
                                         json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                               "ignore_eos": True})
        finally:
            await http.stop()

    response = asyncio.run(main())
    assert response.status_code == 200, response.text
    tracing.flush()
    spans = receiver[0].spans
    deadline = time.monotonic() + 30  # each process sends its batch within EXPORT_DELAY_MS
    while not {span.name for span in spans} >= EXPECTED and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {span.name for span in spans} >= EXPECTED, sorted({span.name for span in spans})
    assert {span.trace_id for span in spans} == {CLIENT_TRACE_ID}
    named = {span.name: span for span in spans}
    request, route, prefill = named["pdserve.request"], named["pdserve.route"], named["pdserve.prefill"]
    assert {span.name: span.service for span in spans} == {
        "pdserve.request": "pdserve-gateway", "pdserve.route": "pdserve-router",
        **dict.fromkeys(("pdserve.prefill", "pdserve.queue", "pdserve.prefill_chunk", "pdserve.kv_send"),
                        "pdserve-prefill"),
        **dict.fromkeys(("pdserve.kv_receive", "pdserve.decode_admission", "pdserve.decode_stream"),
                        "pdserve-decode")}
    assert request.parent_id == CLIENT_SPAN_ID and route.parent_id == request.span_id
    assert route.attributes["pdserve.prefill_worker"] == "prefill-0"
    assert route.attributes["pdserve.decode_worker"] == "decode-0"
    assert route.attributes["pdserve.cache_hit"] is False
    for name in ("pdserve.prefill", "pdserve.decode_admission", "pdserve.decode_stream"):
        assert named[name].parent_id == route.span_id, name
    chunks = [span for span in spans if span.name == "pdserve.prefill_chunk"]
    assert all(span.parent_id == prefill.span_id for span in chunks + [named["pdserve.queue"]])
    assert sorted(span.attributes["pdserve.tokens"] for span in chunks) == [5, 16, 16]
    sends = [span for span in spans if span.name == "pdserve.kv_send"]
    # Both workers on this host: the KV goes through shared memory (cluster/transfer/shm.py).
    assert all(span.parent_id == prefill.span_id and span.attributes["pdserve.transport"] == "shm" for span in sends)
    [last] = [span for span in sends if span.attributes["pdserve.last"]]
    assert named["pdserve.kv_receive"].parent_id == last.span_id  # joined through the KV frame's header
    assert sum(span.attributes["pdserve.bytes"] for span in sends) == named["pdserve.kv_receive"].attributes[
        "pdserve.bytes"]
    assert named["pdserve.decode_admission"].attributes["pdserve.outcome"] == "kv"
    assert named["pdserve.decode_stream"].attributes["pdserve.output_tokens"] == 6
    documented = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    assert not [name for name in named if f"`{name}`" not in documented], "spans missing from docs/observability.md"
