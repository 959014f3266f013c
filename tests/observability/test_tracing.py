"""Traces in one process: the HTTP and gRPC doors over a local engine, and a prefill and a decode
worker joined by the loopback connector, their spans caught by the SDK's in-memory exporter.
(tests/ray_cluster/test_tracing_on_ray.py follows one request across the Ray cluster's processes.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan, Tracer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cluster.common.loads import TransferStats
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.grpc_stubs import pdserve_pb2 as pb
from cluster.grpc_stubs import pdserve_pb2_grpc
from cluster.observability import tracing
from cluster.ray_cluster.config import cluster_config_from
from cluster.serving.grpc.server import GrpcServer
from cluster.serving.http.gateway import HttpServer, build_app
from cluster.serving.local_service import LocalService
from cluster.transfer.connector import KVHeader, TransferError
from cluster.transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.worker import Worker
from tests.worker.test_worker_disaggregated import make_engine

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
PROMPT = list(range(3, 40))  # 37 tokens: several chunks under a budget of 16 tokens per step
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def engine_config(path: Path, budget: int = 16) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(path)), cache=CacheConfig(block_size=4, num_blocks=128),
                        scheduler=SchedulerConfig(max_num_batched_tokens=budget))


@pytest.fixture
def exported() -> Iterator[Callable[[], list[ReadableSpan]]]:
    """Tracing on in this process, into memory; a callable that returns the spans finished so far."""
    memory = InMemorySpanExporter()
    tracing.configure(tracing.TracingConfig(), "test", exporter=memory)

    def spans() -> list[ReadableSpan]:
        tracing.flush()
        return list(memory.get_finished_spans())

    yield spans
    tracing.shutdown()


def by_name(spans: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    named: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def with_local_http(path: Path, work: Callable[[str], Any]) -> Any:
    """Run `work(url)` against the HTTP gateway over a local engine, in this loop."""
    service = await LocalService.from_config(engine_config(path)).start()
    server = HttpServer(build_app(service, api_key=""), "127.0.0.1", 0)
    await server.start()
    try:
        return await work(server.url)
    finally:
        await server.stop()
        await service.stop()


async def complete(url: str, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as client:
        return await client.post(url + "/v1/completions", headers=headers,
                                 json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True})


def test_http_request_continues_the_clients_trace_down_to_each_prompt_chunk(
        checkpoint: Path, exported: Callable[[], list[ReadableSpan]]) -> None:
    response = asyncio.run(with_local_http(checkpoint, lambda url: complete(url, {"traceparent": CLIENT_TRACEPARENT})))
    assert response.status_code == 200, response.text
    spans = by_name(exported())
    [request], [generate], [queue] = spans["pdserve.request"], spans["pdserve.generate"], spans["pdserve.queue"]
    assert {span.context.trace_id for group in spans.values() for span in group} == {int(CLIENT_TRACE_ID, 16)}
    assert parent_of(request) == int(CLIENT_SPAN_ID, 16)
    assert request.attributes["pdserve.door"] == "http"
    assert request.attributes["pdserve.prompt_tokens"] == len(PROMPT)
    assert request.attributes["pdserve.completion_tokens"] == 5
    assert parent_of(generate) == request.context.span_id
    assert parent_of(queue) == generate.context.span_id
    chunks = sorted(spans["pdserve.prefill_chunk"], key=lambda span: span.attributes["pdserve.first_token"])
    assert len(chunks) == 3  # 37 prompt tokens at 16 per step
    assert all(parent_of(chunk) == generate.context.span_id for chunk in chunks)
    assert [chunk.attributes["pdserve.tokens"] for chunk in chunks] == [16, 16, 5]
    assert [chunk.attributes["pdserve.first_token"] for chunk in chunks] == [0, 16, 32]
    assert queue.end_time <= chunks[0].start_time
    assert request.start_time <= generate.start_time and generate.end_time <= request.end_time


def test_a_malformed_traceparent_starts_a_new_trace_and_the_request_succeeds(
        checkpoint: Path, exported: Callable[[], list[ReadableSpan]]) -> None:
    response = asyncio.run(with_local_http(checkpoint, lambda url: complete(url, {"traceparent": "00-zz-nonsense-01"})))
    assert response.status_code == 200, response.text
    [request] = by_name(exported())["pdserve.request"]
    assert request.parent is None  # a root of its own


def test_sample_ratio_zero_records_nothing_anywhere(checkpoint: Path) -> None:
    memory = InMemorySpanExporter()
    tracing.configure(tracing.TracingConfig(sample_ratio=0.0), "test", exporter=memory)
    try:
        response = asyncio.run(with_local_http(checkpoint, lambda url: complete(url, {})))
        tracing.flush()
    finally:
        tracing.shutdown()
    assert response.status_code == 200, response.text
    assert memory.get_finished_spans() == ()


def test_off_the_tracer_is_never_called(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off (no endpoint), no span is made and no context string parsed or built, even for a request
    that carries a traceparent: each of those would raise here."""
    def tripped(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the tracer was called with tracing off")

    monkeypatch.setattr(Tracer, "start_span", tripped)
    monkeypatch.setattr(TraceContextTextMapPropagator, "extract", tripped)
    monkeypatch.setattr(TraceContextTextMapPropagator, "inject", tripped)
    tracing.configure(tracing.TracingConfig(endpoint=""), "test")
    assert not tracing.enabled()
    response = asyncio.run(with_local_http(checkpoint, lambda url: complete(url, {"traceparent": CLIENT_TRACEPARENT})))
    assert response.status_code == 200, response.text


def test_grpc_request_continues_the_trace_in_its_metadata(
        checkpoint: Path, exported: Callable[[], list[ReadableSpan]]) -> None:
    async def main() -> list[pb.GenerateResponse]:
        service = await LocalService.from_config(engine_config(checkpoint)).start()
        server = GrpcServer(service, "127.0.0.1", 0, api_key="")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = pdserve_pb2_grpc.InferenceServiceStub(channel)
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT),
                                             sampling=pb.SamplingParams(max_tokens=4))
                return [response async for response in stub.Generate(request,
                                                                     metadata=(("traceparent", CLIENT_TRACEPARENT),))]
        finally:
            await server.stop(0)
            await service.stop()

    responses = asyncio.run(main())
    assert responses[-1].finished
    spans = by_name(exported())
    [request], [generate] = spans["pdserve.request"], spans["pdserve.generate"]
    assert request.attributes["pdserve.door"] == "grpc"
    assert request.attributes["pdserve.completion_tokens"] == 4
    assert request.context.trace_id == int(CLIENT_TRACE_ID, 16)
    assert parent_of(request) == int(CLIENT_SPAN_ID, 16)
    assert parent_of(generate) == request.context.span_id


def test_the_kv_receive_span_joins_the_trace_through_the_frame_header(
        checkpoint: Path, exported: Callable[[], list[ReadableSpan]]) -> None:
    """Prefill and decode workers (the loopback connector carries the header as UCX does): the
    decode worker's receive span is a child of the prefill worker's last send, named only by the
    header; the router's part is played by the test, under a span of its own."""
    tokens = asyncio.run(traced_pair(checkpoint))
    assert len(tokens) == GREEDY.max_tokens
    spans = by_name(exported())
    [route] = spans["pdserve.route"]
    [prefill], [admission], [stream], [receive] = (spans[name] for name in (
        "pdserve.prefill", "pdserve.decode_admission", "pdserve.decode_stream", "pdserve.kv_receive"))
    sends = spans["pdserve.kv_send"]
    assert {span.context.trace_id for group in spans.values() for span in group} == {int(CLIENT_TRACE_ID, 16)}
    assert [parent_of(span) for span in (prefill, admission, stream)] == [route.context.span_id] * 3
    assert all(parent_of(send) == prefill.context.span_id for send in sends)
    [last] = [send for send in sends if send.attributes["pdserve.last"]]
    assert parent_of(receive) == last.context.span_id
    assert sum(send.attributes["pdserve.bytes"] for send in sends) == receive.attributes["pdserve.bytes"]
    assert {send.attributes["pdserve.transport"] for send in sends} == {"loopback"}
    assert admission.attributes["pdserve.outcome"] == "kv"
    assert stream.attributes["pdserve.output_tokens"] == GREEDY.max_tokens
    assert prefill.attributes["pdserve.worker_id"] == "prefill-0"
    assert sum(chunk.attributes["pdserve.tokens"] for chunk in spans["pdserve.prefill_chunk"]) == len(PROMPT)


async def traced_pair(checkpoint: Path, fail_sends: int = 0) -> list[int]:
    """One request through a prefill and a decode worker on the loopback connector, the test playing
    the router under a `pdserve.route` span; `fail_sends`: break that many KV sends first."""
    hub = LoopbackHub()
    if fail_sends:
        hub.fail_next(fail_sends)
    prefill = Worker("prefill-0", "prefill", make_engine(checkpoint, budget=16), sender=LoopbackSender(hub))
    decode = Worker("decode-0", "decode", make_engine(checkpoint), receiver=LoopbackReceiver(hub, "d"))
    await prefill.start()
    await decode.start()
    try:
        with tracing.route("r1", CLIENT_TRACEPARENT, "disaggregated") as route:
            return await serve_traced(prefill, decode, "r1", route.traceparent)
    finally:
        await prefill.stop()
        await decode.stop()


def test_a_failed_kv_send_is_an_error_span_and_the_admission_says_recomputed(
        checkpoint: Path, exported: Callable[[], list[ReadableSpan]]) -> None:
    tokens = asyncio.run(traced_pair(checkpoint, fail_sends=1))
    assert len(tokens) == GREEDY.max_tokens
    spans = by_name(exported())
    [send] = spans["pdserve.kv_send"]
    assert send.status.status_code == StatusCode.ERROR and send.events[0].name == "exception"
    assert "pdserve.kv_receive" not in spans
    [admission] = spans["pdserve.decode_admission"]
    assert admission.attributes["pdserve.outcome"] == "recomputed"
    assert spans["pdserve.decode_stream"][0].attributes["pdserve.output_tokens"] == GREEDY.max_tokens


async def serve_traced(prefill: Worker, decode: Worker, request_id: str, trace: str) -> list[int]:
    """The router's part of one request, passing its trace on to each worker call."""
    ticket = await decode.reserve(request_id, PROMPT, GREEDY, trace=trace)
    assert ticket is not None
    tokens: list[int] = []
    try:
        async for item in prefill.prefill(request_id, PROMPT, GREEDY, ticket, trace=trace):
            tokens += [] if isinstance(item, TransferStats) else item.new_token_ids
    except TransferError:  # as the router does: the decode worker computes the prompt itself
        await decode.recompute(request_id, tokens[0] if tokens else None)
    async for output in decode.stream(request_id, tokens[0] if tokens else None, trace=trace):
        tokens += output.token_ids[len(tokens):]
    return tokens


def test_the_frame_header_carries_a_traceparent_and_refuses_an_oversized_one() -> None:
    header = KVHeader(request_id="r", num_tokens=8, num_blocks=2, block_size=4, num_layers=1, num_kv_heads=1,
                      head_dim=2, dtype="float32", first_token_id=1, nbytes=64, traceparent=CLIENT_TRACEPARENT)
    assert KVHeader.from_bytes(header.to_bytes()).traceparent == CLIENT_TRACEPARENT
    for bad in ("x" * 129, 7):
        with pytest.raises(TransferError, match="malformed header"):
            KVHeader.from_bytes(KVHeader(**{**_fields(header), "traceparent": bad}).to_bytes())


def _fields(header: KVHeader) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(header)


def test_the_cluster_config_reads_tracing_and_checks_the_ratio() -> None:
    config = cluster_config_from({"tracing": {"endpoint": "http://collector:4317", "sample_ratio": 0.25}})
    assert config.tracing == tracing.TracingConfig("http://collector:4317", 0.25)
    assert config.tracing.enabled and not cluster_config_from({}).tracing.enabled
    with pytest.raises(ValueError, match=r"sample_ratio must be in \[0, 1\]"):
        cluster_config_from({"tracing": {"sample_ratio": 1.5}})


def test_serve_takes_the_endpoint_from_its_flag_else_from_the_opentelemetry_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.cli import build_parser, cluster_overrides
    from cluster.ray_cluster.config import load_cluster_config

    def config_of(*flags: str) -> tracing.TracingConfig:
        return load_cluster_config(None, cluster_overrides(build_parser().parse_args(["serve", *flags]))).tracing

    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    assert not config_of().enabled
    assert config_of("--otlp-traces-endpoint", "http://a:4317", "--otlp-traces-sample-ratio", "0.1") == \
        tracing.TracingConfig("http://a:4317", 0.1)
    monkeypatch.setenv(tracing.ENDPOINT_ENV, "http://b:4317")
    assert config_of().endpoint == "http://b:4317"
    assert config_of("--otlp-traces-endpoint", "http://a:4317").endpoint == "http://a:4317"
