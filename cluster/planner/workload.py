"""The workload a plan is for: when requests arrive and how long their prompts and answers are.

A workload file is JSON, one of two shapes:

```json
{"arrival": "poisson", "rate": 2.0, "num_requests": 200, "seed": 0,
 "prompt": {"kind": "uniform", "low": 128, "high": 512},
 "output": {"kind": "lognormal", "median": 64, "sigma": 0.6, "max": 256}}
```

`arrival`: "poisson" (exponential gaps at `rate` per second), "constant" (one every 1/rate s) or
"burst" (`burst_size` requests at once, bursts at rate/burst_size per second). Lengths: "constant"
(`value`), "uniform" (`low`..`high`, inclusive) or "lognormal" (`median`, `sigma`, capped at `max`).
Or a recorded trace: `{"trace": [{"arrival_s": 0.0, "prompt_tokens": 300, "output_tokens": 40}, ...]}`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.planner.profile import read_json_object

ARRIVALS = ("poisson", "constant", "burst")
LENGTH_KINDS = ("constant", "uniform", "lognormal")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.arrival_s < 0:
            raise ValueError(f"a request needs arrival_s >= 0, prompt_tokens >= 1 and output_tokens >= 1, got {self}")


@dataclass(frozen=True, slots=True)
class Lengths:
    kind: str = "constant"
    value: int = 128
    low: int = 1
    high: int = 1
    median: float = 64.0
    sigma: float = 0.5
    max: int = 4096

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if self.kind == "uniform" and not 1 <= self.low <= self.high:
            raise ValueError(f"uniform lengths need 1 <= low <= high, got {self.low} and {self.high}")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "constant":
            return self.value
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return max(1, min(self.max, round(rng.lognormvariate(math.log(self.median), self.sigma))))


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    arrival: str = "poisson"
    rate: float = 1.0
    num_requests: int = 100
    burst_size: int = 1
    seed: int = 0
    prompt: Lengths = field(default_factory=lambda: Lengths(value=256))
    output: Lengths = field(default_factory=lambda: Lengths(value=64))

    def __post_init__(self) -> None:
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.rate <= 0 or self.num_requests < 1 or self.burst_size < 1:
            raise ValueError("a workload needs rate > 0, num_requests >= 1 and burst_size >= 1")

    def requests(self) -> list[RequestSpec]:
        rng = random.Random(self.seed)
        arrivals = self._arrivals(rng)
        return [RequestSpec(at, self.prompt.draw(rng), self.output.draw(rng)) for at in arrivals]

    def _arrivals(self, rng: random.Random) -> list[float]:
        if self.arrival == "constant":
            return [index / self.rate for index in range(self.num_requests)]
        if self.arrival == "burst":
            return [(index // self.burst_size) * self.burst_size / self.rate for index in range(self.num_requests)]
        now, times = 0.0, []
        for _ in range(self.num_requests):
            times.append(now)
            now += rng.expovariate(self.rate)
        return times


def workload_from_dict(values: dict[str, Any]) -> list[RequestSpec]:
    if "trace" in values:
        try:
            trace = [RequestSpec(**entry) for entry in values["trace"]]
        except TypeError as error:
            raise ValueError(f"trace entries need arrival_s, prompt_tokens, output_tokens: {error}") from None
        return sorted(trace, key=lambda spec: spec.arrival_s)
    values = dict(values)
    try:
        for key in ("prompt", "output"):
            if key in values:
                values[key] = Lengths(**values[key])
        return WorkloadSpec(**values).requests()
    except TypeError as error:
        raise ValueError(f"unknown workload key: {error}") from None


def load_workload(path: str | Path) -> list[RequestSpec]:
    return workload_from_dict(read_json_object(path, "workload"))
