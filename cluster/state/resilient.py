"""Serving on while Redis is down or slow: a circuit breaker around a `SharedState`, with fallbacks.

    closed ──a call fails──> open: calls skip Redis ──backoff_s later──> one call probes Redis
      ^                        ^                                              │
      │                        └──── it fails: backoff doubles (1, 2, 4 ... 10 s) ──┤
      └─────────────────────────────── it succeeds: "Redis back" ──────────────────┘
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from redis.exceptions import RedisError

from cluster.state.in_process import InProcessState
from cluster.state.interface import RateDecision, SharedState, WorkerInfo, check_bucket, check_ttl

log = logging.getLogger(__name__)
T = TypeVar("T")
# What Redis being down or slow looks like; anything else is a bug and propagates.
FAILURES = (RedisError, OSError, TimeoutError)


class Admission(enum.Enum):
    CALL = "call"  # circuit closed: call Redis
    PROBE = "probe"  # circuit open, backoff over: this one call tries Redis
    SKIP = "skip"  # circuit open: answer the fallback at once


class CircuitBreaker:
    """Closed: every call goes to Redis. A failure opens it: calls skip Redis for `backoff_s`, then
    one call probes. The probe's success closes it; its failure doubles the backoff, up to a cap."""

    def __init__(self, min_backoff_s: float, max_backoff_s: float) -> None:
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.opened_at: float | None = None
        self.backoff_s = min_backoff_s
        self.retry_at = 0.0
        self.probing = False

    @property
    def closed(self) -> bool:
        return self.opened_at is None

    def admit(self, now: float) -> Admission:
        if self.closed:
            return Admission.CALL
        if self.probing or now < self.retry_at:
            return Admission.SKIP
        self.probing = True
        return Admission.PROBE

    def failed(self, now: float, admission: Admission) -> None:
        if admission is Admission.PROBE:
            self.probing = False
            self.backoff_s = min(self.backoff_s * 2, self.max_backoff_s)
        elif self.closed:
            self.opened_at, self.backoff_s = now, self.min_backoff_s
        else:
            return  # a call admitted before the circuit opened: it is open already
        self.retry_at = now + self.backoff_s

    def succeeded(self, now: float) -> float | None:
        """Closes the circuit; returns how long it was open, or None if it was closed."""
        if self.opened_at is None:
            return None
        down_s, self.opened_at, self.probing, self.backoff_s = now - self.opened_at, None, False, self.min_backoff_s
        return down_s

    def abandoned(self, admission: Admission) -> None:
        """The call was cancelled: neither success nor failure, but let another call probe."""
        if admission is Admission.PROBE:
            self.probing = False


class ResilientState(SharedState):
    """`primary` (Redis) when it answers within `timeout_s`; otherwise a safe answer at once, so that a
    slow or absent Redis never stops serving: `match` {} (route by load alone), `take` from this
    process's own buckets (rate limits per replica, never off), `workers` the last list Redis gave plus
    the workers registered through this object, writes dropped. `fallbacks` counts them per method, for
    metrics. It recovers by itself.

    Heartbeats of workers registered through this object re-register them when Redis has lost them
    (restarted empty), and answer False so the worker publishes its cached blocks again."""

    def __init__(self, primary: SharedState, *, timeout_s: float = 0.25, min_backoff_s: float = 1.0,
                 max_backoff_s: float = 10.0, log_every_s: float = 30.0) -> None:
        self.primary = primary
        self.timeout_s = timeout_s
        self.breaker = CircuitBreaker(min_backoff_s, max_backoff_s)
        self.log_every_s = log_every_s
        self.logged_at = -math.inf
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.last_workers: list[WorkerInfo] = []
        # Workers registered through this object: worker id -> (info, when its registration expires).
        self.local: dict[str, tuple[WorkerInfo, float]] = {}
        self.own_buckets = InProcessState()  # the rate limits' buckets while Redis is away

    @property
    def healthy(self) -> bool:
        return self.breaker.closed

    async def call(self, method: str, call: Callable[[], Awaitable[T]], fallback: T) -> T:
        admission = self.breaker.admit(time.monotonic())
        if admission is Admission.SKIP:
            self.fallbacks[method] += 1
            return fallback
        try:
            result = await asyncio.wait_for(call(), self.timeout_s)
        except FAILURES as error:
            self.breaker.failed(time.monotonic(), admission)
            self.fallbacks[method] += 1
            self.warn(method, error)
            return fallback
        except BaseException:
            self.breaker.abandoned(admission)
            raise
        down_s = self.breaker.succeeded(time.monotonic())
        if down_s is not None:
            log.warning("shared state: Redis back after %.1f s (%d fallbacks so far)", down_s,
                        self.fallbacks.total())
            self.logged_at = -math.inf
        return result

    def warn(self, method: str, error: BaseException) -> None:
        """At most one warning per `log_every_s`: an outage must not flood the log."""
        now = time.monotonic()
        if now - self.logged_at >= self.log_every_s:
            self.logged_at = now
            log.warning("shared state: Redis unavailable (%s: %s); serving fallbacks (%d so far), retrying in %.1f s",
                        method, f"{type(error).__name__}: {error}", self.fallbacks.total(), self.breaker.backoff_s)

    async def publish_blocks(self, worker_id: str, stored: Sequence[int], evicted: Sequence[int]) -> None:
        await self.call("publish_blocks", lambda: self.primary.publish_blocks(worker_id, stored, evicted), None)

    async def match(self, hashes: Sequence[int], worker_ids: Sequence[str]) -> dict[str, int]:
        return await self.call("match", lambda: self.primary.match(hashes, worker_ids), {})

    async def forget_worker(self, worker_id: str) -> None:
        await self.call("forget_worker", lambda: self.primary.forget_worker(worker_id), None)

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        check_ttl(ttl_s)
        self.local[info.worker_id] = (info, time.monotonic() + ttl_s)
        await self.call("register", lambda: self.primary.register(info, ttl_s), None)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        listed = await self.call("heartbeat", lambda: self.primary.heartbeat(worker_id, ttl_s), True)
        local = self.local.pop(worker_id, None)
        if local is None:
            return listed
        info, expires_at = local
        if listed:
            self.local[worker_id] = (info, time.monotonic() + ttl_s)
            return True
        if expires_at <= time.monotonic():
            return False  # silent past its ttl: expired here too
        # Alive by our count but unknown to Redis: Redis restarted empty. Register it again (if Redis
        # is away once more, the next heartbeat does), and say it was not listed: whatever else the
        # worker had published (its cached blocks) is gone too.
        await self.register(info, ttl_s)
        return False

    async def deregister(self, worker_id: str) -> None:
        self.local.pop(worker_id, None)
        await self.call("deregister", lambda: self.primary.deregister(worker_id), None)

    async def workers(self, role: str | None = None) -> list[WorkerInfo]:
        listed = await self.call("workers", self.primary.workers, None)
        if listed is not None:
            self.last_workers = listed
        else:
            now = time.monotonic()
            merged = {info.worker_id: info for info in self.last_workers}
            merged.update((worker_id, info) for worker_id, (info, expires_at) in self.local.items() if expires_at > now)
            listed = sorted(merged.values(), key=lambda info: info.worker_id)
        return [info for info in listed if role is None or info.role == role]

    async def take(self, key: str, amount: float, rate_per_s: float, burst: float) -> RateDecision:
        """Redis's shared bucket; while Redis is away, this process's own (the limits hold per gateway
        replica then, never off)."""
        check_bucket(amount, rate_per_s, burst)
        decision = await self.call("take", lambda: self.primary.take(key, amount, rate_per_s, burst), None)
        if decision is None:
            return await self.own_buckets.take(key, amount, rate_per_s, burst)
        return decision

    async def close(self) -> None:
        await self.primary.close()
