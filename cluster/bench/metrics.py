"""What a serving benchmark measures, computed from the timestamps its drivers record.

A driver records, per request, when it was sent, when each *token-carrying* chunk of the stream
arrived (and how many output tokens that chunk carried), when the stream ended, and the token
counts the server reported. Everything else is derived here, so the arithmetic can be tested on
made-up timestamps without a server:

    sent        chunk 0      chunk 1        chunk 2 (2 tokens)     end
     |-----------|------------|-----------------------|-------------|
     0   TTFT   0.1   0.05   0.15        0.1          0.25
                      ITL                ITL/2, ITL/2

- TTFT: first chunk - sent.
- ITL: one value per output token after the first: the gap before its chunk, split evenly among the
  chunk's tokens (tokens that came with the first token count 0: they arrived with it).
- TPOT: (end-to-end - TTFT) / (output tokens - 1); undefined (None) for a one-token output.
- E2E: end - sent.
- Goodput: completed requests per second whose TTFT, TPOT and E2E all meet the given targets
  (milliseconds), as vLLM's benchmark_serving defines it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
SLO_NAMES = ("ttft", "tpot", "e2el")  # vLLM's names for the --goodput targets


@dataclass(slots=True)
class RequestRecord:
    """One request as a driver saw it. Times are `time.perf_counter()` seconds."""

    start: float
    expected_output_tokens: int = 0  # max_tokens sent (with ignore_eos: what the output should be)
    tag: str = ""  # the workload's class of request ("long", "short", ...), for per-class summaries
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # output tokens per such chunk
    end: float = 0.0
    prompt_tokens: int = 0  # as the server reported
    output_tokens: int = 0  # as the server reported; else the sum of chunk_tokens
    error: str | None = None

    def add_chunk(self, when: float, num_tokens: int) -> None:
        self.chunk_times.append(when)
        self.chunk_tokens.append(num_tokens)

    def fail(self, error: str, when: float) -> RequestRecord:
        self.error, self.end = error, when
        return self

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        return inter_token_latencies(self.chunk_times, self.chunk_tokens)

    def as_dict(self) -> dict[str, Any]:
        """The derived figures, relative to `start` (seconds): what a JSON report keeps per request."""
        row: dict[str, Any] = {"tag": self.tag, "prompt_tokens": self.prompt_tokens,
                               "output_tokens": self.output_tokens, "error": self.error, "e2e_s": self.e2e,
                               "expected_output_tokens": self.expected_output_tokens}
        if self.ok:
            row.update(ttft_s=self.ttft, tpot_s=self.tpot, chunks=len(self.chunk_times))
        return row


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """One latency per output token after the first (see the module docstring)."""
    if not chunk_times:
        return []
    latencies = [0.0] * (chunk_tokens[0] - 1)
    for previous, now, count in zip(chunk_times, chunk_times[1:], chunk_tokens[1:], strict=False):
        latencies += [(now - previous) / count] * count
    return latencies


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary statistics of one metric, in milliseconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of_seconds(cls, values: Iterable[float]) -> Distribution:
        array = np.asarray(list(values), dtype=np.float64) * 1000.0
        if array.size == 0:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
        p50, p90, p95, p99 = np.percentile(array, PERCENTILES)  # linear interpolation, as numpy's default
        return cls(int(array.size), float(array.mean()), float(p50), float(p90), float(p95), float(p99),
                   float(array.max()))


@dataclass(frozen=True, slots=True)
class BenchSummary:
    """A run's figures. Throughputs count completed requests over the whole run's `duration_s`."""

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens of completed requests / s
    output_throughput: float  # output tokens / s
    good_requests: int | None  # None without targets
    goodput: float | None  # good requests / s
    slos_ms: dict[str, float]
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    errors: dict[str, int]  # message -> how many requests failed with it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """A completed request within every target; a one-token output has no TPOT and meets that one."""
    if not record.ok:
        return False
    tpot = record.tpot or 0.0
    measured = {"ttft": record.ttft, "tpot": tpot, "e2el": record.e2e}
    return all(measured[name] * 1000.0 <= target for name, target in slos_ms.items())


def summarize(records: Sequence[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None) -> \
        BenchSummary:
    done = [record for record in records if record.ok]
    failed = [record for record in records if not record.ok]
    input_tokens = sum(record.prompt_tokens for record in done)
    output_tokens = sum(record.output_tokens for record in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    good = sum(meets_slos(record, slos_ms) for record in done) if slos_ms else None
    return BenchSummary(
        num_requests=len(records), completed=len(done), failed=len(failed), duration_s=duration_s,
        input_tokens=input_tokens, output_tokens=output_tokens, request_throughput=len(done) * per_s,
        input_throughput=input_tokens * per_s, output_throughput=output_tokens * per_s, good_requests=good,
        goodput=None if good is None else good * per_s, slos_ms=dict(slos_ms or {}),
        ttft_ms=Distribution.of_seconds(record.ttft for record in done),
        tpot_ms=Distribution.of_seconds(tpot for record in done if (tpot := record.tpot) is not None),
        itl_ms=Distribution.of_seconds(itl for record in done for itl in record.itls()),
        e2e_ms=Distribution.of_seconds(record.e2e for record in done),
        errors=dict(Counter(record.error or "no output" for record in failed).most_common()))


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        name = "e2el" if name == "e2e" else name
        if name not in SLO_NAMES or not value:
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME one of {', '.join(SLO_NAMES)}; "
                             f"got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the target must be positive")
    return slos
