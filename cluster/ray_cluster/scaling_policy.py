"""When the live controller grows or shrinks a pool: its signals and its hysteresis, no Ray.

Each look (`ScalingConfig.interval_s`) the controller (`cluster.ray_cluster.scaler`) reads every
worker's load and turns the loads of one pool into `PoolSignals`, measured over the time since its
last look from the request-time histograms the workers already count for /metrics:

- queue depth: requests waiting for a running slot per worker now, beyond its slots (every pool;
  `queued`);
- TTFT: the p90 of the time a prompt waited plus the time it computed (prefill and colocated pools);
- ITL: seconds per generated token, decode time over tokens generated (decode and colocated pools).

`PoolHysteresis.decide` grows a pool whose signal passes its target for `sustain_s` on end, and
shrinks one whose every signal stays under `scale_down_below` of its target for
`scale_down_sustain_s` (unset: `sustain_s`), while one worker fewer would run the requests it
holds within that fraction of its slots; after either, the pool is left alone for `cooldown_s`.
Three things keep it from flapping: the gap between the target and its low water, the sustain on
each side (the shrinking one may be the longer, so that a lull inside a step keeps the worker),
and the cooldown. The bounds always win: a pool below `min_workers` grows,
one above `max_workers` shrinks, at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.common.loads import BucketCounts, WorkerLoad
from cluster.common.roles import Role
from cluster.ray_cluster.config import PoolBounds, ScalingConfig

QUEUE_TIME = "vllm:request_queue_time_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
DECODE_TIME = "vllm:request_decode_time_seconds"
GENERATION_TOKENS = "vllm:request_generation_tokens"
TTFT_QUANTILE = 0.9
UP, DOWN = "up", "down"


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """One pool's load over one look; 0 where nothing was measured (no request ended meanwhile)."""

    workers: int
    queue_depth: float = 0.0  # requests waiting per worker
    ttft_s: float = 0.0
    itl_s: float = 0.0
    held: int = 0  # requests the pool holds in all, running or waiting
    slots: int = 0  # requests its workers run at once, summed (their max_num_seqs)


@dataclass(frozen=True, slots=True)
class Decision:
    """Grow (`UP`) or shrink (`DOWN`) a pool, and why: `reason` is a metric label (the signal, or
    `idle`, `below_min`, `above_max`), `detail` the numbers for the log line, `since` when its
    signal began to call for it (the clock `decide` was given; the decision's time for the bounds)."""

    pool: str
    direction: str
    reason: str
    detail: str
    since: float = 0.0


def _delta(name: str, before: WorkerLoad | None, now: WorkerLoad) -> BucketCounts | None:
    """The histogram `name` of one worker counted since `before` (all of it for a new worker)."""
    counts = now.histograms.get(name)
    if counts is None:
        return None
    if before is None or before.started_at != now.started_at:  # new, or restarted: counted from 0
        return counts
    earlier = before.histograms.get(name)
    if earlier is None or earlier.bounds != counts.bounds:
        return counts
    return BucketCounts(counts.bounds, [a - b for a, b in zip(counts.counts, earlier.counts, strict=True)],
                        counts.total - earlier.total)


def _summed(name: str, before: dict[str, WorkerLoad], loads: list[WorkerLoad]) -> BucketCounts | None:
    """The pool's histogram `name` counted since the last look, over every worker."""
    deltas = [d for load in loads if (d := _delta(name, before.get(load.worker_id), load)) is not None]
    if not deltas:
        return None
    return BucketCounts(deltas[0].bounds, [sum(column) for column in zip(*(d.counts for d in deltas), strict=True)],
                        sum(d.total for d in deltas))


def quantile(counts: BucketCounts | None, q: float) -> float:
    """The upper bound of the bucket holding the `q` quantile (the last finite bound for +Inf's); 0
    when nothing was counted."""
    if counts is None or counts.count == 0:
        return 0.0
    wanted = q * counts.count
    for bound, running in counts.cumulative():
        if running >= wanted:
            return bound if bound != float("inf") else counts.bounds[-1]
    return counts.bounds[-1]


def queued(load: WorkerLoad) -> int:
    """Requests on a worker that wait for a running slot: its engine's waiting queue or, on a decode
    worker, those it holds beyond its slots (`max_num_seqs`; where unknown, beyond the running ones).
    A request reserved while its prompt computes elsewhere, with a slot free for it, does not wait."""
    slots = max(load.max_num_seqs, load.num_running) if load.max_num_seqs else load.num_running
    return max(load.num_waiting, load.num_held - slots)


def held(load: WorkerLoad) -> int:
    """Requests on a worker, running or waiting (a decode worker's reserved and landed ones too)."""
    return max(load.num_held, load.num_running + load.num_waiting)


def pool_signals(role: str, before: dict[str, WorkerLoad], loads: list[WorkerLoad]) -> PoolSignals:
    """The signals of the pool of `role` whose workers' loads are `loads` now and were `before`
    (by worker id) at the last look."""
    if not loads:
        return PoolSignals(0)
    queue_depth = sum(queued(load) for load in loads) / len(loads)
    ttft = itl = 0.0
    if role in (Role.PREFILL, Role.COLOCATED):
        ttft = quantile(_summed(QUEUE_TIME, before, loads), TTFT_QUANTILE) + \
            quantile(_summed(PREFILL_TIME, before, loads), TTFT_QUANTILE)
    if role in (Role.DECODE, Role.COLOCATED):
        decode, tokens = _summed(DECODE_TIME, before, loads), _summed(GENERATION_TOKENS, before, loads)
        itl = decode.total / tokens.total if decode is not None and tokens is not None and tokens.total > 0 else 0.0
    return PoolSignals(len(loads), queue_depth, ttft, itl, sum(held(load) for load in loads),
                       sum(load.max_num_seqs for load in loads))


def _watched(role: str, config: ScalingConfig) -> list[tuple[str, float]]:
    """(signal name, target) the pool of `role` is judged by; a target of 0 is not watched."""
    targets = [("queue_depth", config.queue_depth)]
    if role in (Role.PREFILL, Role.COLOCATED):
        targets.append(("ttft_s", config.ttft_s))
    if role in (Role.DECODE, Role.COLOCATED):
        targets.append(("itl_s", config.itl_s))
    return [(name, target) for name, target in targets if target > 0]


class PoolHysteresis:
    """One pool's decisions over time: since when it has been over (or under) its targets, and when
    it last changed. Owned and called by the controller, one look at a time."""

    def __init__(self, role: str, config: ScalingConfig) -> None:
        self.role, self.config = role, config
        self.bounds: PoolBounds = config.bounds(role)
        self.over_since: float | None = None
        self.under_since: float | None = None
        self.changed_at = float("-inf")

    def decide(self, signals: PoolSignals, now: float) -> Decision | None:
        """The decision this look makes for the pool (None: leave it), given its signals at `now`."""
        if signals.workers < self.bounds.min_workers:
            return self._made(UP, "below_min", f"{signals.workers} < min_workers {self.bounds.min_workers}", now, now)
        if signals.workers > self.bounds.max_workers:
            return self._made(DOWN, "above_max", f"{signals.workers} > max_workers {self.bounds.max_workers}", now,
                              now)
        watched = _watched(self.role, self.config)
        over = [(name, getattr(signals, name), target) for name, target in watched if getattr(signals, name) > target]
        under = all(getattr(signals, name) <= self.config.scale_down_below * target for name, target in watched) \
            and self._fits_fewer(signals)
        self.over_since = (self.over_since if self.over_since is not None else now) if over else None
        self.under_since = (self.under_since if self.under_since is not None else now) if under and not over else None
        if now - self.changed_at < self.config.cooldown_s:
            return None
        if self.over_since is not None and now - self.over_since >= self.config.sustain_s \
                and signals.workers < self.bounds.max_workers:
            name, value, target = over[0]
            return self._made(UP, name, f"{name} {value:.3g} > {target:g} for {now - self.over_since:.1f} s", now,
                              self.over_since)
        if self.under_since is not None and now - self.under_since >= self.config.down_sustain_s \
                and signals.workers > self.bounds.min_workers:
            detail = ", ".join([f"{name} {getattr(signals, name):.3g}" for name, _ in watched]
                               + [f"{signals.held} held in {signals.slots} slots"])
            return self._made(DOWN, "idle", f"{detail} under {self.config.scale_down_below:g} of the targets for "
                                            f"{now - self.under_since:.1f} s", now, self.under_since)
        return None

    def _fits_fewer(self, signals: PoolSignals) -> bool:
        """Whether one worker fewer would run what the pool holds within `scale_down_below` of its
        slots: a pool whose slots are busy is not idle, however short its queue."""
        if signals.workers < 2:
            return True
        return signals.held <= self.config.scale_down_below * signals.slots * (signals.workers - 1) / signals.workers

    def _made(self, direction: str, reason: str, detail: str, now: float, since: float) -> Decision:
        self.changed_at, self.over_since, self.under_since = now, None, None
        return Decision(self.role, direction, reason, detail, since)

    def acted(self, now: float) -> None:
        """A change made from outside the looks (an operator's): the cooldown starts again."""
        self.changed_at, self.over_since, self.under_since = now, None, None
