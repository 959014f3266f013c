"""The serving benchmark: drive a running server over HTTP (OpenAI API) or gRPC and measure it.

    pdserve bench --url http://127.0.0.1:8000 --request-rate 2 --num-requests 100 --goodput ttft:500 tpot:50
    pdserve bench --grpc 127.0.0.1:50051 --max-concurrency 8 --workload shared-prefix --json run.json

A run: wait until the server is ready, send `warmup` requests (not counted), then start each
conversation of the workload (`cluster.bench.workloads`) at its arrival time, at most
`max_concurrency` at once, and stream every answer, recording when each token-carrying chunk
arrives (`cluster.bench.metrics.RequestRecord`). A failed request is recorded with its error and
the run goes on. The summary (TTFT, TPOT, ITL, end-to-end latency, throughputs, goodput) is computed
from those records alone, after the run.

Token accounting. gRPC chunks carry their token ids. OpenAI's streaming chunks carry text, and a
step whose text is held back (half a UTF-8 character, a possible stop string) sends no chunk at
all, so the next one carries two tokens. The HTTP driver therefore asks for `logprobs` (0
alternatives), which makes the gateway send one chunk per step with one entry per token: exact
counts, at the cost of a log-softmax per sampled row on the server. `logprobs=False` leaves them
out; each text chunk then counts as one token for ITL, and the totals come from the usage chunk
(`stream_options.include_usage`).

Only numpy, rich and (lazily) httpx or the gRPC client are imported: this module runs without torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cluster.bench.arrivals import arrival_offsets
from cluster.bench.metrics import BenchSummary, Distribution, RequestRecord, parse_goodput, summarize
from cluster.bench.workloads import (
    WORKLOADS,
    BenchRequest,
    Conversation,
    WorkloadConfig,
    build_workload,
    total_requests,
)
from cluster.common import env


@dataclass(frozen=True, slots=True)
class DriverOptions:
    temperature: float = 0.0
    ignore_eos: bool = True  # outputs exactly max_tokens long: the workload controls the load
    logprobs: bool = True  # HTTP: exact tokens per chunk (see the module docstring)
    timeout_s: float = 600.0  # per request
    api_key: str | None = None  # None: $PDSERVE_API_KEY, if set


@dataclass(frozen=True, slots=True)
class LoadConfig:
    request_rate: float = math.inf  # conversation starts per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps: 1 is Poisson
    max_concurrency: int = 0  # conversations in flight at most; 0: no limit
    warmup: int = 1  # requests sent (and not counted) before the run
    ready_timeout_s: float = 300.0
    seed: int = 0


class Driver(Protocol):
    description: str

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once the server answers requests; RuntimeError after `timeout_s`."""
        ...

    async def send(self, request: BenchRequest) -> RequestRecord:
        """Stream one request to its end. Never raises for a failed request: the record says why."""
        ...

    async def close(self) -> None: ...


# ---- HTTP (OpenAI API, server-sent events) ------------------------------------------------------

class HttpDriver:
    """Streams completions (token-id prompts) and chat completions (messages) with httpx."""

    def __init__(self, url: str, options: DriverOptions = DriverOptions()) -> None:
        import httpx

        self.url, self.options = url.rstrip("/"), options
        self.description = f"HTTP {self.url}"
        api_key = options.api_key if options.api_key is not None else os.environ.get(env.API_KEY)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.url, headers=headers,
                                        timeout=httpx.Timeout(options.timeout_s, connect=30.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.model: str | None = None

    async def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                # /ready is pdserve's; another OpenAI server may not have it (404) and is ready once it answers.
                if (await self.client.get("/ready")).status_code in (200, 404):
                    models = (await self.client.get("/v1/models")).json()["data"]
                    self.model = models[0]["id"]
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url} is not ready after {timeout_s:g} s")
            await asyncio.sleep(0.5)

    def body(self, request: BenchRequest) -> tuple[str, dict[str, Any]]:
        """The endpoint and JSON body of a request."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": request.max_tokens,
                                "temperature": self.options.temperature, "ignore_eos": self.options.ignore_eos,
                                "stream": True, "stream_options": {"include_usage": True}}
        if request.is_chat:
            body["messages"] = request.prompt
            if self.options.logprobs:
                body["logprobs"] = True
            return "/v1/chat/completions", body
        body["prompt"] = request.prompt
        if self.options.logprobs:
            body["logprobs"] = 0
        return "/v1/completions", body

    async def send(self, request: BenchRequest) -> RequestRecord:
        import httpx

        path, body = self.body(request)
        record = RequestRecord(time.perf_counter(), request.max_tokens, request.tag)
        done = False
        try:
            async with self.client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    return record.fail(f"HTTP {response.status_code}: {error_message(text)}", time.perf_counter())
                async for line in response.aiter_lines():
                    done = read_event(record, line, time.perf_counter())
                    if done:
                        break
        except httpx.HTTPError as error:
            return record.fail(f"{type(error).__name__}: {error}", time.perf_counter())
        except (ValueError, KeyError, TypeError) as error:  # an event that is not the API's JSON
            return record.fail(f"malformed event: {type(error).__name__}: {error}", time.perf_counter())
        record.end = time.perf_counter()
        if not done and record.error is None:
            record.error = "the stream ended without [DONE]"
        return finish_record(record, request)

    async def close(self) -> None:
        await self.client.aclose()


def read_event(record: RequestRecord, line: str, when: float) -> bool:
    """Apply one server-sent-events line to `record`; True at `data: [DONE]`. Other lines (blank
    separators, comments, `event:`) carry nothing here."""
    if not line.startswith("data:"):
        return False
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return True
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        record.error = str(error.get("message") if isinstance(error, dict) else error)
    if usage := event.get("usage"):
        record.prompt_tokens, record.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    for choice in event.get("choices") or []:
        if count := tokens_in(choice):
            record.add_chunk(when, count)
    return False


def tokens_in(choice: dict[str, Any]) -> int:
    """Output tokens in one streamed choice: exact with logprobs (one entry per token), else 1 per
    chunk with text (completions' `text`, chat's `delta.content`)."""
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        entries = logprobs.get("tokens") if "tokens" in logprobs else logprobs.get("content")
        return len(entries or [])
    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
    return 1 if text else 0


def error_message(body: str) -> str:
    """OpenAI's error JSON's message, else the body (cut short)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200]


def finish_record(record: RequestRecord, request: BenchRequest) -> RequestRecord:
    """Fill the counts the server did not report; a request without tokens has failed."""
    if not record.output_tokens:
        record.output_tokens = sum(record.chunk_tokens)
    if not record.prompt_tokens:
        record.prompt_tokens = request.prompt_len
    if record.error is None and not record.chunk_times:
        record.error = "no output tokens"
    return record


# ---- gRPC (cluster.client) -------------------------------------------------------------------

class GrpcDriver:
    """Streams `Generate` calls with the SDK's `AsyncClient`, without retries (a benchmark counts
    failures; it does not hide them)."""

    def __init__(self, target: str, options: DriverOptions = DriverOptions()) -> None:
        from cluster.client import AsyncClient

        self.options = options
        self.description = f"gRPC {target}"
        self.client = AsyncClient(target, api_key=options.api_key, timeout=options.timeout_s, max_attempts=1)

    async def wait_ready(self, timeout_s: float) -> None:
        from cluster.client import ClientError

        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(ClientError):
                if await self.client.health(timeout=5.0) == "SERVING":
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.description} is not serving after {timeout_s:g} s")
            await asyncio.sleep(0.5)

    async def send(self, request: BenchRequest) -> RequestRecord:
        from cluster.client import ClientError

        record = RequestRecord(time.perf_counter(), request.max_tokens, request.tag)
        try:
            async with self.client.generate(request.prompt, max_tokens=request.max_tokens,
                                            temperature=self.options.temperature,
                                            ignore_eos=self.options.ignore_eos) as stream:
                async for chunk in stream:
                    if chunk.token_ids:
                        record.add_chunk(time.perf_counter(), len(chunk.token_ids))
                    if chunk.usage is not None:
                        record.prompt_tokens = chunk.usage.prompt_tokens
                        record.output_tokens = chunk.usage.completion_tokens
                    if chunk.finish_reason in ("abort", "error"):
                        record.error = f"finish reason {chunk.finish_reason}"
        except ClientError as error:
            return record.fail(str(error), time.perf_counter())
        record.end = time.perf_counter()
        return finish_record(record, request)

    async def close(self) -> None:
        await self.client.close()


def make_driver(url: str = "", grpc_target: str = "", options: DriverOptions = DriverOptions()) -> Driver:
    if bool(url) == bool(grpc_target):
        raise ValueError("give the server as either --url (HTTP) or --grpc (host:port)")
    return HttpDriver(url, options) if url else GrpcDriver(grpc_target, options)


# ---- the run --------------------------------------------------------------------------------

@dataclass(slots=True)
class BenchRun:
    records: list[RequestRecord]
    duration_s: float  # from the first request sent to the last answer's end (warmup excluded)
    load_average: tuple[tuple[float, ...], tuple[float, ...]]  # at the start, at the end

    def summary(self, slos_ms: dict[str, float] | None = None, tag: str | None = None) -> BenchSummary:
        """The whole run's figures; with `tag`, those of its requests of that class, over the same duration."""
        records = self.records if tag is None else [r for r in self.records if r.tag == tag]
        return summarize(records, self.duration_s, slos_ms)

    @property
    def tags(self) -> list[str]:
        return sorted({record.tag for record in self.records if record.tag})


async def run_benchmark(driver: Driver, conversations: Sequence[Conversation], load: LoadConfig,
                        console: Console | None = None) -> BenchRun:
    """Send the workload at its arrival times; `console` shows a progress bar (None: silent)."""
    await driver.wait_ready(load.ready_timeout_s)
    for _ in range(load.warmup):
        await driver.send(warmup_request(conversations[0].turns[0]))
    offsets = arrival_offsets(len(conversations), load.request_rate, load.burstiness, load.seed)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency > 0 else None
    records: list[RequestRecord] = []
    load_before = os.getloadavg()
    with _progress(console) as progress:
        task = progress.add_task("requests", total=total_requests(conversations), failed=0)
        failed = 0

        async def converse(conversation: Conversation, offset: float) -> None:
            nonlocal failed
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with limit if limit is not None else contextlib.nullcontext():
                for turn in conversation.turns:
                    records.append(await driver.send(turn))
                    failed += not records[-1].ok
                    progress.update(task, advance=1, failed=failed)

        start = time.perf_counter()
        await asyncio.gather(*(converse(c, t) for c, t in zip(conversations, offsets, strict=True)))
        duration = time.perf_counter() - start
    return BenchRun(records, duration, (load_before, os.getloadavg()))


def warmup_request(first: BenchRequest) -> BenchRequest:
    """A request of the size of the workload's first, so the server's first pass at that size is not
    timed; its token ids reversed, so the prefix cache has nothing of the run's prompts from it."""
    prompt = first.prompt if first.is_chat else first.prompt[::-1]
    return BenchRequest(prompt, min(first.max_tokens, 4), "warmup")


def _progress(console: Console | None) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("[red]{task.fields[failed]} failed"), TimeElapsedColumn(),
                    console=console, disable=console is None)


async def benchmark(driver: Driver, workload: WorkloadConfig, load: LoadConfig,
                    console: Console | None = None) -> BenchRun:
    """Build the workload, run it, close the driver."""
    conversations = build_workload(workload)
    try:
        return await run_benchmark(driver, conversations, load, console)
    finally:
        await driver.close()


# ---- reports --------------------------------------------------------------------------------

def summary_table(summary: BenchSummary, title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    for column in ("mean", "p50", "p90", "p95", "p99", "max"):
        table.add_column(column, justify="right")
    rows: list[tuple[str, Distribution]] = [("TTFT ms", summary.ttft_ms), ("TPOT ms", summary.tpot_ms),
                                            ("ITL ms", summary.itl_ms), ("E2E ms", summary.e2e_ms)]
    for name, stats in rows:
        table.add_row(name, *(f"{getattr(stats, key):.1f}" for key in ("mean", "p50", "p90", "p95", "p99", "max")))
    table.caption = caption(summary)
    return table


def caption(summary: BenchSummary) -> str:
    lines = [f"{summary.completed}/{summary.num_requests} completed, {summary.failed} failed in "
             f"{summary.duration_s:.1f} s: {summary.request_throughput:.2f} req/s, "
             f"{summary.input_throughput:.1f} input + {summary.output_throughput:.1f} output tok/s"]
    if summary.goodput is not None:
        targets = ", ".join(f"{name} <= {value:g} ms" for name, value in summary.slos_ms.items())
        lines.append(f"goodput {summary.goodput:.2f} req/s ({summary.good_requests} requests met {targets})")
    lines += [f"[red]{count} x {message}" for message, count in list(summary.errors.items())[:5]]
    return "\n".join(lines)


def report(run: BenchRun, slos_ms: dict[str, float], settings: dict[str, Any], per_request: bool = True) -> \
        dict[str, Any]:
    """The JSON report: settings, when and under what machine load, the summary (per request class
    too, when the workload has several), and optionally each request's figures."""
    data: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(), "load_average_at_start": run.load_average[0],
        "load_average_at_end": run.load_average[1], **settings, "summary": run.summary(slos_ms).as_dict()}
    if len(run.tags) > 1:
        data["summary_by_tag"] = {tag: run.summary(slos_ms, tag).as_dict() for tag in run.tags}
    if per_request:
        data["requests"] = [record.as_dict() for record in run.records]
    return finite(data)


def finite(value: Any) -> Any:
    """NaN (a metric with no sample) as None, an infinite rate as "inf": JSON has neither."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and math.isinf(value):
        return str(value)
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


# ---- the command line (`pdserve bench --url ...`) ------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The serving benchmark's flags. `--num-requests`, `--seed`, `--temperature` and `--json` are
    the bench command's own, shared with the offline benchmark."""
    target = parser.add_argument_group("serving benchmark: the server (one of)")
    target.add_argument("--url", default="", help="benchmark a running server over HTTP (OpenAI API)")
    target.add_argument("--grpc", default="", metavar="HOST:PORT", help="benchmark a running server over gRPC")
    target.add_argument("--api-key", default=None, help="default: $PDSERVE_API_KEY")
    target.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    target.add_argument("--no-logprobs", action="store_true",
                        help="HTTP: do not ask for logprobs; ITL then counts chunks, not tokens")
    load = parser.add_argument_group("serving benchmark: load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="conversations started per second (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 Poisson, <1 bursty")
    load.add_argument("--max-concurrency", type=int, default=0, help="in flight at most (0: no limit; with "
                      "the default rate, a closed loop of this many clients)")
    load.add_argument("--warmup", type=int, default=1, help="requests sent first, not counted")
    load.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                      help="targets for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    work = parser.add_argument_group("serving benchmark: workload")
    work.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    work.add_argument("--input-len", type=int, default=128, help="median prompt tokens")
    work.add_argument("--output-len", type=int, default=64, help="median output tokens")
    work.add_argument("--input-sigma", type=float, default=0.5, help="lognormal sigma of prompt lengths (0: fixed)")
    work.add_argument("--output-sigma", type=float, default=0.5, help="lognormal sigma of output lengths (0: fixed)")
    work.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: system prompt tokens")
    work.add_argument("--turns", type=int, default=3, help="shared-prefix: turns per conversation")
    work.add_argument("--long-len", type=int, default=2048, help="long-mix: tokens of a long prompt")
    work.add_argument("--long-fraction", type=float, default=0.25, help="long-mix: share of long prompts")
    work.add_argument("--dataset", default="", help="file: JSONL of {\"messages\": [...]} per line")
    work.add_argument("--token-ids", default="1000:30000", metavar="LOW:HIGH",
                      help="random prompt token ids from [LOW, HIGH): inside the model's vocabulary")


def workload_of(args: argparse.Namespace) -> WorkloadConfig:
    low, _, high = args.token_ids.partition(":")
    try:
        token_range = (int(low), int(high))
    except ValueError:
        raise ValueError(f"--token-ids takes LOW:HIGH, got {args.token_ids!r}") from None
    return WorkloadConfig(kind=args.workload, num_requests=args.num_requests, input_len=args.input_len,
                          output_len=args.output_len, input_sigma=args.input_sigma, output_sigma=args.output_sigma,
                          prefix_len=args.prefix_len, turns=args.turns, long_len=args.long_len,
                          long_fraction=args.long_fraction, dataset=args.dataset, token_range=token_range,
                          seed=args.seed or 0)


def command(args: argparse.Namespace) -> int:
    """Run one serving benchmark from the command line; 1 if no request completed."""
    slos = parse_goodput(args.goodput)
    workload = workload_of(args)
    load = LoadConfig(request_rate=args.request_rate, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, warmup=args.warmup, seed=args.seed or 0)
    arrival_offsets(1, load.request_rate, load.burstiness)  # bad values fail before connecting
    options = DriverOptions(temperature=args.temperature, logprobs=not args.no_logprobs, timeout_s=args.timeout,
                            api_key=args.api_key)
    driver = make_driver(args.url, args.grpc, options)
    console = Console()
    console.print(f"[bold]pdserve bench[/]: {workload.num_requests} {workload.kind} requests to "
                  f"{driver.description}, rate {load.request_rate:g}/s, concurrency {load.max_concurrency or 'any'}")
    try:
        run = asyncio.run(benchmark(driver, workload, load, console))
    except RuntimeError as error:
        console.print(f"[red]pdserve bench: {error}")
        return 1
    summary = run.summary(slos)
    console.print(summary_table(summary, f"pdserve bench: {driver.description}"))
    if args.json:
        settings = {"benchmark": "serve", "target": driver.description, "workload": asdict(workload),
                    "load": asdict(load), "driver": {**asdict(options), "api_key": None}}
        with open(args.json, "w") as file:
            json.dump(report(run, slos, settings), file, indent=2)
        console.print(f"[green]wrote {args.json}")
    return 0 if summary.completed else 1
