"""The serving benchmark: its arithmetic on known timestamps, its workloads and arrivals, and a
short run against a live gateway and gRPC server on a tiny random model (every request accounted
for, token counts right). Nothing here asserts that the machine is fast."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from cluster.bench.arrivals import arrival_offsets
from cluster.bench.metrics import Distribution, RequestRecord, inter_token_latencies, parse_goodput, summarize
from cluster.bench.serving import (
    BenchRun,
    GrpcDriver,
    HttpDriver,
    LoadConfig,
    benchmark,
    read_event,
    run_benchmark,
    tokens_in,
)
from cluster.bench.workloads import (
    BenchRequest,
    Conversation,
    WorkloadConfig,
    build_workload,
    read_conversations,
)
from cluster.cli import main as cli_main
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.serving.grpc.server import GrpcServer
from cluster.serving.http.gateway import HttpServer, build_app
from cluster.serving.local_service import LocalService
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

T = TypeVar("T")
TINY_TOKENS = (3, 300)  # inside the tiny model's 320-id vocabulary, above its special tokens


def record_of(start: float, chunks: list[tuple[float, int]], end: float, error: str | None = None) -> RequestRecord:
    record = RequestRecord(start, expected_output_tokens=sum(n for _, n in chunks))
    for when, count in chunks:
        record.add_chunk(when, count)
    record.end, record.output_tokens, record.prompt_tokens, record.error = end, sum(n for _, n in chunks), 10, error
    return record


# ---- metrics from known timestamps ------------------------------------------------------------------

def test_one_token_per_chunk_gives_ttft_itl_tpot_and_e2e() -> None:
    record = record_of(0.0, [(0.1, 1), (0.15, 1), (0.25, 1)], end=0.25)
    assert record.ok
    assert record.ttft == pytest.approx(0.1)
    assert record.itls() == pytest.approx([0.05, 0.1])
    assert record.tpot == pytest.approx(0.075)  # (0.25 - 0.1) / (3 - 1)
    assert record.e2e == pytest.approx(0.25)


def test_a_chunk_of_several_tokens_splits_its_gap_evenly() -> None:
    record = record_of(1.0, [(1.2, 2), (1.5, 3), (1.6, 1)], end=1.7)
    # The first chunk's second token came with the first (0); the 0.3 s gap is shared by 3 tokens.
    assert record.itls() == pytest.approx([0.0, 0.1, 0.1, 0.1, 0.1])
    assert len(record.itls()) == record.output_tokens - 1
    assert record.tpot == pytest.approx((0.7 - 0.2) / 5)
    assert inter_token_latencies([], []) == []


def test_a_one_token_output_has_no_tpot() -> None:
    record = record_of(0.0, [(0.3, 1)], end=0.31)
    assert record.tpot is None and record.itls() == []


def test_summary_percentiles_throughputs_and_failures() -> None:
    records = [record_of(0.0, [(ttft, 1), (ttft + 0.1, 1)], end=ttft + 0.1) for ttft in (0.1, 0.2, 0.3, 0.4)]
    records.append(record_of(0.0, [], end=0.5, error="HTTP 400: bad"))
    summary = summarize(records, duration_s=2.0)
    assert (summary.num_requests, summary.completed, summary.failed) == (5, 4, 1)
    assert summary.errors == {"HTTP 400: bad": 1}
    assert summary.request_throughput == pytest.approx(2.0)
    assert summary.input_throughput == pytest.approx(4 * 10 / 2.0)
    assert summary.output_throughput == pytest.approx(4 * 2 / 2.0)
    ttft = summary.ttft_ms
    assert ttft.count == 4 and ttft.mean == pytest.approx(250) and ttft.p50 == pytest.approx(250)
    assert ttft.max == pytest.approx(400)
    assert ttft.p90 == pytest.approx(370)  # linear interpolation: 300 + 0.7 * 100
    assert ttft.p99 == pytest.approx(397)
    assert summary.itl_ms.count == 4 and summary.itl_ms.mean == pytest.approx(100)
    assert summary.goodput is None


def test_goodput_counts_completed_requests_within_every_target() -> None:
    fast = record_of(0.0, [(0.1, 1), (0.15, 1), (0.2, 1)], end=0.2)  # ttft 100 ms, tpot 50 ms
    slow_first = record_of(0.0, [(0.4, 1), (0.45, 1)], end=0.45)  # ttft 400 ms
    slow_tokens = record_of(0.0, [(0.1, 1), (0.3, 1)], end=0.3)  # tpot 200 ms
    one_token = record_of(0.0, [(0.1, 1)], end=0.1)  # no tpot: meets that target
    failed = record_of(0.0, [], end=0.1, error="boom")
    summary = summarize([fast, slow_first, slow_tokens, one_token, failed], 4.0, parse_goodput(["ttft:200", "tpot:60"]))
    assert summary.good_requests == 2
    assert summary.goodput == pytest.approx(0.5)
    assert summarize([fast], 1.0, {"e2el": 150}).good_requests == 0


def test_goodput_targets_are_parsed_or_refused() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2e:9000"]) == {"ttft": 500, "tpot": 50, "e2el": 9000}
    for bad in (["ttft"], ["latency:5"], ["tpot:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_an_empty_distribution_is_nan_not_an_error() -> None:
    assert Distribution.of_seconds([]).count == 0 and math.isnan(Distribution.of_seconds([]).p99)


# ---- server-sent events --------------------------------------------------------------------------

def test_sse_lines_are_read_into_the_record() -> None:
    record = RequestRecord(0.0)
    completion = {"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}
    assert not read_event(record, "data: " + json.dumps(completion), 0.5)
    assert not read_event(record, "", 0.5)
    assert not read_event(record, ": a comment", 0.5)
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}
    assert not read_event(record, "data: " + json.dumps(usage), 0.6)
    assert read_event(record, "data: [DONE]", 0.7)
    assert (record.chunk_times, record.chunk_tokens, record.prompt_tokens, record.output_tokens) == ([0.5], [2], 7, 2)
    read_event(record, 'data: {"error": {"message": "internal error: X", "type": "server_error"}}', 0.8)
    assert record.error == "internal error: X" and not record.ok


def test_tokens_per_chunk_from_logprobs_else_one_per_text_chunk() -> None:
    assert tokens_in({"delta": {"role": "assistant", "content": ""}}) == 0  # chat's opening chunk
    assert tokens_in({"delta": {"content": "hi"}, "logprobs": {"content": [{}, {}, {}]}}) == 3
    assert tokens_in({"delta": {}, "logprobs": {"content": [{}]}}) == 1  # a token whose text is held back
    assert tokens_in({"text": "", "logprobs": {"tokens": []}, "finish_reason": "abort"}) == 0
    assert tokens_in({"text": "xyz"}) == 1 and tokens_in({"text": ""}) == 0


# ---- arrivals and workloads ---------------------------------------------------------------------------

def test_arrivals_poisson_gamma_and_all_at_once() -> None:
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    poisson = np.diff(arrival_offsets(4001, 4.0, 1.0, seed=1))
    assert poisson.mean() == pytest.approx(0.25, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)
    bursty = np.diff(arrival_offsets(4001, 4.0, 0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.25, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # 1 / sqrt(shape)
    assert arrival_offsets(10, 2.0, seed=3) == arrival_offsets(10, 2.0, seed=3)
    for rate, burstiness in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_offsets(3, rate, burstiness)


def test_synthetic_lengths_and_token_ids() -> None:
    config = WorkloadConfig(num_requests=200, input_len=32, output_len=16, token_range=(10, 20), seed=4)
    requests = [c.turns[0] for c in build_workload(config)]
    assert len(requests) == 200
    assert all(1 <= r.prompt_len <= 8 * 32 and 1 <= r.max_tokens <= 8 * 16 for r in requests)
    assert all(10 <= t < 20 for r in requests for t in r.prompt)  # type: ignore[operator]
    assert np.median([r.prompt_len for r in requests]) == pytest.approx(32, rel=0.2)
    fixed = build_workload(WorkloadConfig(num_requests=3, input_len=5, output_len=7, input_sigma=0, output_sigma=0))
    assert [(c.turns[0].prompt_len, c.turns[0].max_tokens) for c in fixed] == [(5, 7)] * 3
    assert build_workload(config) == build_workload(config)  # seeded


def test_shared_prefix_conversations_resend_their_history() -> None:
    config = WorkloadConfig(kind="shared-prefix", num_requests=7, turns=3, prefix_len=20, input_len=5, seed=2)
    conversations = build_workload(config)
    assert [len(c.turns) for c in conversations] == [3, 3, 1]
    system = conversations[0].turns[0].prompt[:20]
    for conversation in conversations:
        for previous, turn in zip(conversation.turns, conversation.turns[1:], strict=False):
            assert turn.prompt[:20] == system
            # history = the previous prompt, a stand-in reply of its output length, a new user message
            assert turn.prompt[:previous.prompt_len] == previous.prompt
            assert turn.prompt_len > previous.prompt_len + previous.max_tokens
    assert [t.tag for t in conversations[0].turns] == ["turn-1", "turn-2", "turn-3"]


def test_long_mix_has_its_share_of_long_prompts() -> None:
    config = WorkloadConfig(kind="long-mix", num_requests=20, long_fraction=0.25, long_len=300, input_len=10)
    requests = [c.turns[0] for c in build_workload(config)]
    long = [r for r in requests if r.tag == "long"]
    assert len(long) == 5 and all(r.prompt_len == 300 for r in long)
    assert sum(r.tag == "short" for r in requests) == 15


def test_conversations_from_a_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ref"}]}\n'
                    "\n"
                    '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], '
                    '"max_tokens": 9}\n')
    system_and_user = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert read_conversations(str(path)) == [([{"role": "user", "content": "hi"}], None), (system_and_user, 9)]
    requests = [c.turns[0] for c in build_workload(WorkloadConfig(kind="file", dataset=str(path), num_requests=5))]
    assert len(requests) == 5 and all(r.is_chat and r.prompt_len == 0 for r in requests)
    assert requests[1].max_tokens == 9 and requests[3].max_tokens == 9
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="chats.jsonl:2"):
        read_conversations(str(path))


def test_workload_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="workload must be one of"):
        WorkloadConfig(kind="sharegpt")
    with pytest.raises(ValueError, match="dataset"):
        WorkloadConfig(kind="file")
    with pytest.raises(ValueError, match="token id range"):
        WorkloadConfig(token_range=(5, 5))


# ---- a short run against live servers on a tiny model -------------------------------------------------

@dataclass
class LiveServers:
    loop: asyncio.AbstractEventLoop
    http_url: str
    grpc_target: str

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(120)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServers]:
    """The tiny model behind both front doors, on an event loop in a background thread: the
    benchmark (and the CLI, which runs its own loop) drives them from the test's thread."""
    checkpoint = build_tiny_llama_checkpoint(tmp_path_factory.mktemp("bench-tiny"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-test-servers", daemon=True)
    thread.start()
    config = EngineConfig(model=fp32_model(checkpoint), cache=CacheConfig(block_size=4, num_blocks=128))

    async def start() -> tuple[LocalService, HttpServer, GrpcServer]:
        service = await LocalService.from_config(config).start()
        http = HttpServer(build_app(service, api_key=""), "127.0.0.1", 0, graceful_shutdown_s=1)
        grpc = GrpcServer(service, "127.0.0.1", 0, api_key="")
        await http.start()
        await grpc.start()
        return service, http, grpc

    service, http, grpc = asyncio.run_coroutine_threadsafe(start(), loop).result(120)
    live = LiveServers(loop, http.url, f"127.0.0.1:{grpc.port}")
    yield live
    live.run(http.stop())
    live.run(grpc.stop(0))
    live.run(service.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def assert_all_accounted_for(run: BenchRun, requests: list[BenchRequest], exact_chunks: bool = True) -> None:
    """Every request recorded once and completed with its exact token counts."""
    records = run.records
    assert len(records) == len(requests)
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    assert all(r.output_tokens == r.expected_output_tokens for r in records)
    assert sorted(r.expected_output_tokens for r in records) == sorted(q.max_tokens for q in requests)
    token_prompts = sorted(q.prompt_len for q in requests if not q.is_chat)
    assert sorted(r.prompt_tokens for r in records if r.tag != "chat") == token_prompts
    assert all(r.prompt_tokens > 0 for r in records)
    if exact_chunks:
        assert all(sum(r.chunk_tokens) == r.output_tokens and len(r.itls()) == r.output_tokens - 1 for r in records)
    summary = run.summary()
    assert (summary.completed, summary.failed) == (len(requests), 0)
    assert summary.output_tokens == sum(q.max_tokens for q in requests)


def tiny_workload(**fields: Any) -> WorkloadConfig:
    return WorkloadConfig(**{"num_requests": 10, "input_len": 12, "output_len": 6, "input_sigma": 0.3,
                             "output_sigma": 0.3, "token_range": TINY_TOKENS, **fields})


def test_http_synthetic_run_accounts_for_every_request_and_token(servers: LiveServers) -> None:
    workload = tiny_workload()
    run = asyncio.run(benchmark(HttpDriver(servers.http_url), workload, LoadConfig(request_rate=40.0, seed=1)))
    assert_all_accounted_for(run, [c.turns[0] for c in build_workload(workload)])
    assert run.duration_s > 0 and run.summary().request_throughput > 0


def test_http_without_logprobs_still_counts_tokens_from_usage(servers: LiveServers) -> None:
    from cluster.bench.serving import DriverOptions

    workload = tiny_workload(num_requests=4)
    driver = HttpDriver(servers.http_url, DriverOptions(logprobs=False))
    run = asyncio.run(benchmark(driver, workload, LoadConfig(max_concurrency=2)))
    assert_all_accounted_for(run, [c.turns[0] for c in build_workload(workload)], exact_chunks=False)


def test_grpc_multi_turn_and_chat_run(servers: LiveServers, tmp_path: Path) -> None:
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text('{"messages": [{"role": "user", "content": "Hello there"}]}\n'
                       '{"messages": [{"role": "system", "content": "Be brief."}, '
                       '{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 5}\n')
    conversations = build_workload(tiny_workload(kind="shared-prefix", num_requests=7, turns=3, prefix_len=16))
    conversations += build_workload(tiny_workload(kind="file", dataset=str(dataset), num_requests=2))

    async def go() -> BenchRun:
        driver = GrpcDriver(servers.grpc_target)
        try:
            return await run_benchmark(driver, conversations, LoadConfig(max_concurrency=3))
        finally:
            await driver.close()

    run = servers.run(go())  # grpc.aio clients stay on one event loop per process: the servers'
    assert_all_accounted_for(run, [turn for c in conversations for turn in c.turns])
    assert run.tags == ["chat", "turn-1", "turn-2", "turn-3"]
    assert run.summary(tag="turn-3").completed == 2
    # A conversation's turns go one after another: turn 2 leaves after turn 1 has ended.
    starts = sorted(r.start for r in run.records if r.tag == "turn-2")
    ends = sorted(r.end for r in run.records if r.tag == "turn-1")
    assert all(start >= end for start, end in zip(starts, ends, strict=False))  # the i-th after i + 1 ends


def test_failed_requests_are_counted_not_fatal(servers: LiveServers) -> None:
    good = [c for c in build_workload(tiny_workload(num_requests=3))]
    outside_vocabulary = Conversation([BenchRequest([5000, 5001], 4)])
    run = asyncio.run(benchmark_conversations(HttpDriver(servers.http_url), [*good, outside_vocabulary]))
    summary = run.summary()
    assert (summary.num_requests, summary.completed, summary.failed) == (4, 3, 1)
    [(message, count)] = summary.errors.items()
    assert message.startswith("HTTP 400") and count == 1


async def benchmark_conversations(driver: HttpDriver, conversations: list[Conversation]) -> BenchRun:
    try:
        return await run_benchmark(driver, conversations, LoadConfig(warmup=0))
    finally:
        await driver.close()


def test_cli_bench_over_http_prints_and_writes_json(servers: LiveServers, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.json"
    code = cli_main(["bench", "--url", servers.http_url, "--num-requests", "6", "--input-len", "10",
                     "--output-len", "4", "--token-ids", "3:300", "--request-rate", "30", "--goodput", "ttft:60000",
                     "tpot:60000", "--json", str(path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "TTFT ms" in out and "6/6 completed, 0 failed" in out and "goodput" in out
    report = json.loads(path.read_text())
    summary = report["summary"]
    assert summary["completed"] == 6 and summary["good_requests"] == 6
    assert len(report["requests"]) == 6 and report["load"]["request_rate"] == 30
    assert report["workload"]["token_range"] == [3, 300]


def test_cli_bench_refuses_bad_settings_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--url", "http://127.0.0.1:9", "--goodput", "ttft"]) == 2
    assert cli_main(["bench", "--url", "http://127.0.0.1:9", "--burstiness", "0"]) == 2
    assert cli_main(["bench", "--url", "http://127.0.0.1:9", "--grpc", "127.0.0.1:9"]) == 2
    assert "--goodput" in capsys.readouterr().err


def test_sweep_plots_draw_from_summaries(tmp_path: Path) -> None:
    from benchmarks.serve import budget_point, plot_rate_sweep, plot_token_budget

    def run(ttft: float, **fields: Any) -> dict[str, Any]:
        """A sweep's point as `benchmarks.serve.measure` makes it: a summary, and one per request class."""
        long = record_of(0.0, [(ttft, 1), (ttft + 0.1, 1)], end=ttft + 0.1)
        short = record_of(0.0, [(ttft / 2, 1), (ttft / 2 + 0.05, 1)], end=ttft / 2 + 0.05)
        long.tag, short.tag = "long", "short"
        by_tag = {record.tag: summarize([record], 1.0).as_dict() for record in (long, short)}
        return {**fields, **summarize([long, short], 1.0).as_dict(), "by_tag": by_tag}

    plot_rate_sweep([run(0.1, request_rate=1.0), run(0.3, request_rate=2.0), run(0.2, request_rate=math.inf)],
                    tmp_path / "rate.png")
    points = [budget_point(512, [run(0.4), run(0.6)]), budget_point(2048, [run(0.2)])]
    assert points[0]["ttft_p95_long"] == pytest.approx(500) and points[0]["itl_p50"] == pytest.approx(75)
    plot_token_budget(points, tmp_path / "budget.png")
    assert (tmp_path / "rate.png").stat().st_size > 0 and (tmp_path / "budget.png").stat().st_size > 0
