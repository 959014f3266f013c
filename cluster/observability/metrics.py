"""Prometheus metrics for the whole cluster, scraped from one endpoint (`/metrics` on the gateway:
its operator port, `--metrics-port`, or else its API port).

Two sources, so one scrape shows everything:
- `RequestMetrics` times every request as its events pass (`cluster.serving.metered_service` wraps
  the `Service` both front doors use with it): time to first token, inter-token latency, end-to-end
  latency, prompt and generated tokens, finished requests by reason. vLLM's names where the meaning
  is the same, so its dashboards work.
- At scrape time `ClusterMetrics.scrape` takes each worker's `WorkerLoad` (running, waiting, KV
  usage, preemptions, prefix cache, KV transfers, and the histograms its engine counts: vLLM's
  request phases and iteration tokens) and asks for the router's decisions, and reports them
  labelled by worker and role. That fan-out costs Ray calls, so it is made at most once per
  `FAN_OUT_S`: a client scraping in a loop loads no worker more.

Several gateways may serve one set of workers (`--attach`). Each exports its own request metrics
(every request passes one gateway), but only the gateway that owns the workers exports the
worker-level series (`export_workers`), so each worker is one series however many gateways are
scraped. docs/observability.md lists every metric.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from cluster.common.events import TokenEvent
from cluster.common.loads import KV_TRANSFER_EXPOSED, BucketCounts, WorkerLoad
from cluster.common.throttled import Throttled

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# A scrape's fan-out (every worker's load, the routers' counters: Ray calls) is asked for at most
# this often; scrapes in between show the last one. Prometheus scrapes every 15 s or so.
FAN_OUT_S = 1.0
# vLLM's buckets (seconds), so dashboards' quantiles mean the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class RequestMetrics:
    """The per-request metrics, in a registry of their own (tests make several)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", labels,
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.", labels,
                             buckets=E2E_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=registry)
        self.success = Counter("vllm:request_success", "Requests finished, by reason.",
                               [*labels, "finished_reason"], registry=registry)
        self.failed = Counter("pdserve:request_errors", "Requests that ended in an error, by type.",
                              [*labels, "error"], registry=registry)

    def observe(self, events: AsyncIterator[TokenEvent], num_prompt_tokens: int) -> AsyncIterator[TokenEvent]:
        return _timed(self, events, num_prompt_tokens)


async def _timed(metrics: RequestMetrics, events: AsyncIterator[TokenEvent],
                 num_prompt_tokens: int) -> AsyncIterator[TokenEvent]:
    """Pass events through, timing them as a client sees them (at the front door)."""
    model = metrics.model_name
    arrival = last = time.perf_counter()
    first = True
    try:
        async for event in events:
            now = time.perf_counter()
            if event.token_ids:
                if first:
                    metrics.ttft.labels(model).observe(now - arrival)
                    metrics.prompt_tokens.labels(model).inc(num_prompt_tokens)
                    first = False
                    for _ in event.token_ids[1:]:  # came with the first (a stream that lagged merges steps)
                        metrics.itl.labels(model).observe(0.0)
                else:
                    # Several tokens in one event (a relay that batched them) share the gap evenly.
                    for _ in event.token_ids:
                        metrics.itl.labels(model).observe((now - last) / len(event.token_ids))
                metrics.generation_tokens.labels(model).inc(len(event.token_ids))
                last = now
            if event.finished:
                metrics.e2e.labels(model).observe(now - arrival)
                metrics.success.labels(model, str(event.finish_reason)).inc()
            yield event
    except Exception as error:
        metrics.failed.labels(model, type(error).__name__).inc()
        raise


WORKER_GAUGES: dict[str, tuple[str, Callable[[WorkerLoad], float]]] = {
    "vllm:num_requests_running": ("Requests in the worker's running batch.", lambda w: w.num_running),
    "vllm:num_requests_waiting": ("Requests waiting for the worker's batch.", lambda w: w.num_waiting),
    "vllm:kv_cache_usage_perc": ("Fraction of the worker's KV blocks in use (0-1).", lambda w: w.kv_cache_usage),
    "pdserve:kv_cache_free_blocks": ("Free KV blocks.", lambda w: w.num_free_blocks),
    "pdserve:max_num_seqs": ("Requests the worker runs at once (its batch slots; the rest wait).",
                             lambda w: w.max_num_seqs),
}
WORKER_COUNTERS: dict[str, tuple[str, Callable[[WorkerLoad], float]]] = {
    "vllm:num_preemptions": ("Preemptions since the worker started.", lambda w: w.num_preemptions),
    "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", lambda w: w.prefix_cache_queries),
    "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", lambda w: w.prefix_cache_hits),
    "pdserve:kv_transfers": ("KV transfers sent (prefill workers).", lambda w: w.kv_transfers),
    "pdserve:kv_transfer_bytes": ("Bytes of KV sent.", lambda w: w.kv_transfer_bytes),
    "pdserve:kv_transfer_blocks": ("KV blocks sent (prefill workers).", lambda w: w.kv_transfer_blocks),
    "pdserve:decode_prefix_reused_tokens": ("Prompt tokens whose KV a decode worker's prefix cache held when the "
                                            "prompt came: neither computed nor sent again.",
                                            lambda w: w.decode_reused_prompt_tokens),
    "pdserve:local_prefills": ("Prompts a decode worker computed itself because their uncached part was below "
                               "local_prefill_threshold (no prefill worker asked).", lambda w: w.local_prefills),
    "pdserve:prefix_blocks_fetched": ("KV blocks of a prompt's prefix a prefill worker fetched from a peer worker "
                                      "that cached them, instead of computing them.",
                                      lambda w: w.prefix_blocks_fetched),
    "pdserve:prefix_blocks_offered": ("KV blocks of its prefix cache a worker sent to a peer fetching them.",
                                      lambda w: w.prefix_blocks_offered),
    "pdserve:kv_transfer_seconds": ("Seconds spent sending KV (on the wire).", lambda w: w.kv_transfer_seconds),
    "pdserve:kv_transfer_failures": ("KV sends that failed (the decode worker recomputed).",
                                     lambda w: w.kv_transfer_failures),
    "pdserve:kv_recomputes": ("Prompts a decode worker computed itself: their KV never came (failed, or lease over).",
                              lambda w: w.kv_recomputes),
}


SPEC_DECODE_COUNTERS: dict[str, tuple[str, Callable[[WorkerLoad], float]]] = {
    "vllm:spec_decode_num_drafts": ("Rows verified with draft tokens (speculative decoding).",
                                    lambda w: w.spec_decode_num_drafts),
    "vllm:spec_decode_num_draft_tokens": ("Draft tokens verified.", lambda w: w.spec_decode_num_draft_tokens),
    "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted.", lambda w: w.spec_decode_num_accepted_tokens),
}


HOST_KV_GAUGES: dict[str, tuple[str, Callable[[WorkerLoad], float]]] = {
    "pdserve:host_kv_cache_usage_perc": ("Fraction of the worker's host KV tier blocks holding KV (0-1).",
                                         lambda w: w.host_kv_used_blocks / max(w.num_host_kv_blocks, 1)),
    "pdserve:host_kv_cache_blocks": ("Blocks of the worker's host KV tier.", lambda w: w.num_host_kv_blocks),
}
HOST_KV_COUNTERS: dict[str, tuple[str, Callable[[WorkerLoad], float]]] = {
    "pdserve:host_kv_cache_queries": ("Prompt tokens looked up in the host KV tier (past the device pool's hits).",
                                      lambda w: w.host_kv_queries),
    "pdserve:host_kv_cache_hits": ("Prompt tokens found in the host KV tier (also in vllm:prefix_cache_hits).",
                                   lambda w: w.host_kv_hits),
    "pdserve:host_kv_blocks_offloaded": ("KV blocks evicted from the device pool into the host tier.",
                                         lambda w: w.host_kv_offloaded),
    "pdserve:host_kv_blocks_promoted": ("KV blocks copied back from the host tier on a prefix hit.",
                                        lambda w: w.host_kv_promoted),
}


WORKER_HISTOGRAMS: dict[str, str] = {
    "vllm:request_queue_time_seconds": "Time a request waited here before it was first scheduled.",
    "vllm:request_prefill_time_seconds": "Time from first scheduled to first token (prefill and colocated workers).",
    "vllm:request_decode_time_seconds": "Time from first token to the last (decode and colocated workers).",
    "vllm:request_inference_time_seconds": "Time a request ran here: first scheduled to its last token here.",
    "vllm:request_prompt_tokens": "Prompt length of requests finished here (counted where the prompt was computed).",
    "vllm:request_generation_tokens": "Tokens generated by requests finished here (counted where they decoded).",
    "vllm:iteration_tokens_total": "Tokens computed per engine step.",
    KV_TRANSFER_EXPOSED: "The part of a KV transfer after its prefill finished (prefill workers).",
}
LABELS = ["model_name", "worker", "role"]


class _Snapshot(Collector):
    """Reports the worker loads and router decisions taken just before the scrape."""

    def __init__(self, model_name: str, export_workers: bool) -> None:
        self.model_name, self.export_workers = model_name, export_workers
        self.loads: list[WorkerLoad] = []
        self.decisions: dict[str, int] = {}
        self.extra: dict[str, float] = {}
        self.scaling: dict[str, Any] = {}  # the live controller's `Scaler.status` (empty: it is off)
        self.recoveries: dict[str, float] = {}  # the routers' `recovery_stats`, summed

    def collect(self) -> Iterator[Metric]:
        if self.export_workers:
            yield from self._worker_families()
        decisions = CounterMetricFamily("pdserve:router_decisions", "Router decisions by kind.", labels=["decision"])
        for decision, count in self.decisions.items():
            decisions.add_metric([decision], count)
        yield decisions
        for name, total in self.extra.items():
            yield CounterMetricFamily(name, "See docs/observability.md.", value=total)
        if self.recoveries:
            recovery = SummaryMetricFamily(
                "pdserve:worker_recovery_seconds", "Dead workers back in service: seconds from found dead (total) "
                "and of each phase (restart, model_load, init_rest, warm_up, rejoin).", labels=["phase"])
            recovered = int(self.recoveries.get("count", 0))
            for phase, seconds in self.recoveries.items():
                if phase != "count":
                    recovery.add_metric([phase], count_value=recovered, sum_value=seconds)
            yield recovery
        if self.scaling:
            yield from self._scaling_families()

    def _scaling_families(self) -> Iterator[Metric]:
        """The live controller's decisions and the pools' sizes."""
        decisions = CounterMetricFamily("pdserve:scaling_decisions", "Pools grown or shrunk by the live controller.",
                                        labels=["pool", "direction", "reason"])
        for pool, direction, reason, count in self.scaling.get("decisions", []):
            decisions.add_metric([pool, direction, reason], count)
        yield decisions
        sizes = GaugeMetricFamily("pdserve:pool_workers", "Workers in each pool (the live controller's).",
                                  labels=["pool"])
        for pool, size in self.scaling.get("pools", {}).items():
            sizes.add_metric([pool], size)
        yield sizes
        spares = GaugeMetricFamily("pdserve:pool_spares", "Warm spares of each pool: started, not routed to.",
                                   labels=["pool"])
        for pool, ids in self.scaling.get("spares", {}).items():
            spares.add_metric([pool], len(ids))
        yield spares

    def _labels(self, load: WorkerLoad) -> list[str]:
        return [self.model_name, load.worker_id, load.role]

    def _worker_families(self) -> Iterator[Metric]:
        """One series per worker (and role), from its load."""
        for name, (help_text, value) in WORKER_GAUGES.items():
            gauge = GaugeMetricFamily(name, help_text, labels=LABELS)
            for load in self.loads:
                gauge.add_metric(self._labels(load), value(load))
            yield gauge
        for name, (help_text, value) in WORKER_COUNTERS.items():
            counter = CounterMetricFamily(name, help_text, labels=LABELS)
            for load in self.loads:
                counter.add_metric(self._labels(load), value(load))
            yield counter
        for name, help_text in WORKER_HISTOGRAMS.items():
            histogram = HistogramMetricFamily(name, help_text, labels=LABELS)
            for load in self.loads:
                if (counts := load.histograms.get(name)) is not None:
                    histogram.add_metric(self._labels(load), _buckets(counts), counts.total)
            yield histogram
        yield from self._spec_decode_families()
        yield from self._host_kv_families()
        swapped = GaugeMetricFamily("vllm:num_requests_swapped", "Requests whose KV is swapped out to host memory "
                                    "(workers with preemption by swap only).", labels=LABELS)
        for load in self.loads:
            if load.swap_enabled:
                swapped.add_metric(self._labels(load), load.num_swapped)
        yield swapped
        yield from self._cache_config_info()
        workers = GaugeMetricFamily("pdserve:workers", "Live workers by role.", labels=["role"])
        for role in sorted({load.role for load in self.loads}):
            workers.add_metric([role], sum(load.role == role for load in self.loads))
        yield workers

    def _host_kv_families(self) -> Iterator[Metric]:
        """The host KV tier's series, for the workers that have one only."""
        tiered = [load for load in self.loads if load.num_host_kv_blocks > 0]
        for families, kind in ((HOST_KV_GAUGES, GaugeMetricFamily), (HOST_KV_COUNTERS, CounterMetricFamily)):
            for name, (help_text, value) in families.items():
                family = kind(name, help_text, labels=LABELS)
                for load in tiered:
                    family.add_metric(self._labels(load), value(load))
                yield family

    def _spec_decode_families(self) -> Iterator[Metric]:
        """vLLM's speculative decoding counters, for the workers that speculate only (a worker without
        drafts has no series rather than constant zeros)."""
        speculating = [load for load in self.loads if load.num_speculative_tokens > 0]
        for name, (help_text, value) in SPEC_DECODE_COUNTERS.items():
            counter = CounterMetricFamily(name, help_text, labels=LABELS)
            for load in speculating:
                counter.add_metric(self._labels(load), value(load))
            yield counter
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted draft tokens by their position in the draft (0 first).",
                                           labels=[*LABELS, "position"])
        for load in speculating:
            accepted = load.spec_decode_accepted_per_pos
            for position in range(load.num_speculative_tokens):
                count = accepted[position] if position < len(accepted) else 0
                per_position.add_metric([*self._labels(load), str(position)], count)
        yield per_position

    def _cache_config_info(self) -> Iterator[Metric]:
        """vLLM's info gauge (always 1): each worker's cache config as labels; `num_gpu_blocks` is
        vLLM's name for the blocks its pool has (whatever device it is on), `cache_dtype` for its
        `kv_cache_dtype` (auto, fp8, ...)."""
        infos = [{**load.cache_config, "cache_dtype": load.cache_config.get("kv_cache_dtype", "auto"),
                  "num_gpu_blocks": str(load.num_blocks)} for load in self.loads]
        keys = sorted({key for info in infos for key in info})  # one family: the same keys for every worker
        gauge = GaugeMetricFamily("vllm:cache_config_info", "Information of the worker's cache config.",
                                  labels=[*LABELS, *keys])
        for load, info in zip(self.loads, infos, strict=True):
            gauge.add_metric([*self._labels(load), *(info.get(key, "") for key in keys)], 1)
        yield gauge


def _buckets(counts: BucketCounts) -> list[tuple[str, float]]:
    return [(floatToGoString(bound), float(total)) for bound, total in counts.cumulative()]


class ClusterMetrics:
    """Everything `/metrics` shows: the request metrics plus a scrape-time snapshot of the workers
    (with `export_workers` false, as on a gateway attached to another's workers, only the routers')."""

    def __init__(self, model_name: str, export_workers: bool = True) -> None:
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(self.registry, model_name)
        self.snapshot = _Snapshot(model_name, export_workers)
        self.registry.register(self.snapshot)
        # Called at scrape time for more counters: router decisions, Redis fallbacks.
        self.sources: list[Callable[[], Any]] = []
        self._fan_out: Throttled[tuple[list[WorkerLoad], list[Any]]] | None = None

    async def exposition(self, loads: list[WorkerLoad]) -> bytes:
        """The scrape's text, with `loads` the workers' loads taken just now."""
        return self._render(loads, [await source() for source in self.sources])

    async def scrape(self, workers: Callable[[], Awaitable[list[WorkerLoad]]]) -> bytes:
        """The scrape's text, with the workers' loads and the sources' counters asked for at most once
        per `FAN_OUT_S` (each costs Ray calls: one per worker, one per router), however often a
        client scrapes. The request metrics are this process's own: always current."""
        if self._fan_out is None:
            self._fan_out = Throttled(lambda: self._gather(workers), FAN_OUT_S)
        loads, found = await self._fan_out()
        return self._render(loads, found)

    async def _gather(self, workers: Callable[[], Awaitable[list[WorkerLoad]]]) -> tuple[list[WorkerLoad], list[Any]]:
        return await workers(), [await source() for source in self.sources]

    def _render(self, loads: list[WorkerLoad], found: list[Any]) -> bytes:
        self.snapshot.loads = loads
        decisions: dict[str, int] = {}
        extra: dict[str, float] = {}
        for counters in found:
            decisions.update(counters.get("decisions", {}))
            extra.update(counters.get("counters", {}))
            self.snapshot.scaling = counters.get("scaling", self.snapshot.scaling)
            self.snapshot.recoveries = counters.get("recoveries", self.snapshot.recoveries)
        self.snapshot.decisions, self.snapshot.extra = decisions, extra
        return generate_latest(self.registry)
