"""When a benchmark's requests arrive: one arrival process, drawn from a seeded numpy Generator.

An `ArrivalProcess` is a configuration value: `poisson` (exponential gaps of mean 1 / rate),
`gamma` (gaps of the same mean whose shape is the `burstiness`: 1 is Poisson, below 1 burstier,
above 1 more regular) or `fixed` (every 1 / rate seconds, no randomness). An infinite rate sends
everything at once. The times come back in seconds from the run's start, in order:

- `times(rng, count)`: `count` arrivals, the first one gap after `start`;
- `times_until(rng, end)`: every arrival before `end` (the first one gap after `start`).

Scripts that also draw prompts pass their own Generator: the arrival times are drawn first, then
whatever the caller draws next, so a seed gives the same schedule whatever the prompts look like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

PROCESSES = ("poisson", "gamma", "fixed")


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    rate: float  # arrivals per second; inf: all at `start`
    process: str = "poisson"
    burstiness: float = 1.0  # gamma: the gaps' shape (coefficient of variation 1 / sqrt(burstiness))

    def __post_init__(self) -> None:
        if self.process not in PROCESSES:
            raise ValueError(f"the arrival process must be one of {', '.join(PROCESSES)}, got {self.process!r}")
        if not self.rate > 0:
            raise ValueError(f"the request rate must be positive (inf: all at once), got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")

    def gaps(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` gaps between arrivals, in seconds. Poisson and gamma of shape 1 draw the same
        numbers from the same Generator (numpy's gamma of shape 1 is its exponential)."""
        if math.isinf(self.rate):
            return np.zeros(count)
        if self.process == "fixed":
            return np.full(count, 1.0 / self.rate)
        if self.process == "poisson":
            return rng.exponential(1.0 / self.rate, count)
        return rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), count)

    def times(self, rng: np.random.Generator, count: int, start: float = 0.0) -> list[float]:
        return [float(t) for t in start + np.cumsum(self.gaps(rng, count))]

    def times_until(self, rng: np.random.Generator, end: float, start: float = 0.0) -> list[float]:
        """Arrivals in [start, end), drawn one gap at a time (the Generator's state after it is
        the same as after drawing exactly that many gaps, plus the one that went past `end`)."""
        if math.isinf(self.rate):
            raise ValueError("an infinite rate has no end: ask for a count of arrivals instead")
        times, t = [], start + float(self.gaps(rng, 1)[0])
        while t < end:
            times.append(t)
            t += float(self.gaps(rng, 1)[0])
        return times


def arrival_offsets(count: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """The serving driver's schedule: `count` arrivals of a gamma process of shape `burstiness`
    (Poisson at 1) from a Generator seeded with `seed`, the first at 0 (it leaves at once)."""
    process = ArrivalProcess(request_rate, "gamma", burstiness)
    if math.isinf(request_rate):
        return [0.0] * count
    gaps = process.gaps(np.random.default_rng(seed), count)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]
