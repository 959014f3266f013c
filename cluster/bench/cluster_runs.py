"""Driving a started `Cluster` (`cluster.ray_cluster.launcher`) with timed requests, measured at the client.

The cluster benchmarks (disaggregation, scaling step, planner validation and goodput) send token
ids straight to `Cluster.generate`, no HTTP in between. Each `TimedRequest` leaves at its planned
time (`send`); every `TokenEvent` that carries tokens is timestamped as it arrives
(`time.perf_counter`, seconds from the run's start) into the request's `Record`:
TTFT is its first such event's time less the time it was sent, the inter-token gaps those between
consecutive events (an event may carry several tokens). A request that fails, returns a token
count other than its `max_tokens` or an event out of order keeps an `error`; `drive` cancels those
unfinished at its deadline (a hang shows up there) and counts them as errors too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console

from cluster.bench.workloads import TimedRequest, random_tokens
from cluster.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.ray_cluster.launcher import Cluster

console = Console()


@dataclass(slots=True)
class Record:
    request_id: str
    kind: str
    prompt_len: int
    planned_s: float
    sent_s: float = 0.0
    # (seconds from the run's start, tokens in the event) for every event that carried tokens
    events: list[tuple[float, int]] = field(default_factory=list)
    finished_s: float | None = None
    num_tokens: int = 0
    worker_ids: list[str] = field(default_factory=list)
    error: str | None = None

    @classmethod
    def of(cls, request: TimedRequest) -> Record:
        return cls(request.request_id, request.kind, len(request.prompt), request.arrival_s)

    @property
    def ttft_s(self) -> float | None:
        return self.events[0][0] - self.sent_s if self.events else None

    @property
    def gaps_s(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.events, self.events[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (the request's mean inter-token latency)."""
        if self.num_tokens < 2 or not self.events:
            return None
        return (self.events[-1][0] - self.events[0][0]) / (self.num_tokens - 1)


async def send(cluster: Cluster, request: TimedRequest, record: Record, start: float, run_id: str) -> None:
    """Wait for the request's arrival time, send it (greedy, EOS ignored) and record its events."""
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    params = SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)
    record.sent_s = time.perf_counter() - start
    async for event in cluster.generate(request.prompt, params, request_id=f"{run_id}-{request.request_id}"):
        now = time.perf_counter() - start
        if event.token_ids:
            if event.index != record.num_tokens:
                record.error = f"event index {event.index}, expected {record.num_tokens}"
            record.events.append((now, len(event.token_ids)))
            record.num_tokens += len(event.token_ids)
        if event.worker_id not in record.worker_ids:
            record.worker_ids.append(event.worker_id)
        if event.finished:
            record.finished_s = now
    if record.num_tokens != request.max_tokens and record.error is None:
        record.error = f"{record.num_tokens} tokens, expected {request.max_tokens}"


async def drive(cluster: Cluster, requests: list[TimedRequest], run_id: str, deadline_s: float) -> list[Record]:
    """Send every request at its time; those not done `deadline_s` after the start are cancelled."""
    records = [Record.of(request) for request in requests]
    start = time.perf_counter()
    tasks = [asyncio.create_task(send(cluster, q, r, start, run_id)) for q, r in zip(requests, records, strict=True)]
    with console.status(f"{run_id}: {len(requests)} requests") as status:
        while not all(t.done() for t in tasks):
            elapsed = time.perf_counter() - start
            if elapsed > deadline_s:
                break
            done = sum(t.done() for t in tasks)
            status.update(f"{run_id}: {elapsed:5.1f} s, {done}/{len(tasks)} requests done")
            await asyncio.sleep(0.5)
    settle(tasks, records, deadline_s)
    await asyncio.gather(*tasks, return_exceptions=True)
    return records


def settle(tasks: list[asyncio.Task[None]], records: list[Record], deadline_s: float) -> None:
    """Cancel the unfinished tasks; their records, and those of the tasks that raised, get an error."""
    for task, record in zip(tasks, records, strict=True):
        if not task.done():
            task.cancel()
            record.error = record.error or f"unfinished after {deadline_s:.0f} s"
        elif task.exception() is not None:
            record.error = record.error or f"{type(task.exception()).__name__}: {task.exception()}"


async def warm_up(cluster: Cluster) -> None:
    """Two short requests at once (one per worker of a two-worker pool) and two 512-token prompts."""
    rng = np.random.default_rng(12345)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def run(prompt: list[int], request_id: str) -> None:
        async for _ in cluster.generate(prompt, params, request_id=request_id):
            pass

    await asyncio.gather(*(run(random_tokens(rng, 48, (1000, 30000)), f"warm-{i}") for i in range(2)))
    await asyncio.gather(*(run(random_tokens(rng, 512, (1000, 30000)), f"warm-long-{i}") for i in range(2)))
