"""State that router replicas share: which KV blocks each worker holds, which workers are alive, and
how much of its rate limits each API key has used.

One router keeps it in its own process (`InProcessState`). Replicas behind a load balancer share it
through Redis (`cluster.redis_state.RedisState`), wrapped in `cluster.resilient_state.ResilientState`
so that a slow or absent Redis degrades routing and rate limiting instead of stopping them.
`connect_state(url)` picks one.

Who calls what (all coroutines, on the caller's event loop):

    workers, or the router for them    publish_blocks   as the KV cache stores and evicts blocks
                                       register         on start; heartbeat every ttl_s / 3 or so;
                                       deregister       on drain or shutdown
    router                             match            per request, to score prefill candidates
                                       workers          on a timer (not per request): who is alive
                                       forget_worker    when it gives up on a worker
    gateway                            take             per request: requests/s and tokens/min per key
"""

from __future__ import annotations

import abc
import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "colocated")
MAX_BLOCKS_PER_WORKER = 65536  # block hashes remembered per worker (~the blocks of a 1 GiB KV pool)
BUCKET_SWEEP_EVERY = 4096  # takes between sweeps of the in-process buckets that have refilled


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a router needs to reach a worker. `address` is whatever the router dials: a Ray actor
    name, host:port. `meta` is free-form (model, KV block size, zone); not hashable, compare by ==."""

    worker_id: str
    role: str
    address: str
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"WorkerInfo.role is {self.role!r}: use one of {', '.join(ROLES)}")
        if not self.worker_id:
            raise ValueError("WorkerInfo.worker_id is empty: give each worker a unique id")


@dataclass(frozen=True, slots=True)
class RateDecision:
    """`retry_after_s`: 0 when allowed; else seconds until `amount` tokens are in the bucket, and
    `math.inf` when they never will be (amount > burst: refuse the request as too large, not 429)."""

    allowed: bool
    retry_after_s: float
    remaining: float  # tokens left in the bucket after this decision


class SharedState(abc.ABC):
    """The interface; every method is a coroutine so that Redis can stand behind it."""

    @abc.abstractmethod
    async def publish_blocks(self, worker_id: str, stored: Sequence[int], evicted: Sequence[int]) -> None:
        """A batch of the worker's KV cache events: block hashes stored, then those evicted (a hash
        in both ends up absent; publish two batches if the order was the other way)."""

    @abc.abstractmethod
    async def match(self, hashes: Sequence[int], worker_ids: Sequence[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of the chained `hashes` it holds: the count stops
        at the first block it lacks. A worker missing from the answer holds none (a fallback is {})."""

    @abc.abstractmethod
    async def forget_worker(self, worker_id: str) -> None:
        """Drop the worker's blocks (it restarted, or its cache was flushed); its registration stays."""

    @abc.abstractmethod
    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        """List the worker (replacing an earlier `info`) until `ttl_s` passes without a heartbeat."""

    @abc.abstractmethod
    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        """Keep the worker listed for `ttl_s` more. False: it is not listed (it expired, or Redis lost
        it): `register` it again."""

    @abc.abstractmethod
    async def deregister(self, worker_id: str) -> None:
        """Unlist the worker and drop its blocks."""

    @abc.abstractmethod
    async def workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Workers whose registration has not expired, of `role` if given, sorted by id."""

    @abc.abstractmethod
    async def take(self, key: str, amount: float, rate_per_s: float, burst: float) -> RateDecision:
        """Take `amount` tokens from `key`'s bucket (holding at most `burst`, refilling `rate_per_s`),
        all or nothing. A new key starts full; `amount=0` only looks."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; the object is unusable afterwards."""


def leading_run(flags: Iterable[object]) -> int:
    """How many flags are truthy before the first falsy one."""
    count = 0
    for flag in flags:
        if not flag:
            break
        count += 1
    return count


def check_bucket(amount: float, rate_per_s: float, burst: float) -> None:
    finite = all(math.isfinite(number) for number in (amount, rate_per_s, burst))
    if not finite or amount < 0 or rate_per_s <= 0 or burst <= 0:
        raise ValueError(f"take(amount={amount}, rate_per_s={rate_per_s}, burst={burst}): give finite numbers, "
                         "amount >= 0, rate_per_s and burst > 0")


def check_ttl(ttl_s: float) -> None:
    if not (ttl_s > 0 and math.isfinite(ttl_s)):
        raise ValueError(f"ttl_s is {ttl_s}: give a positive, finite number of seconds")


@dataclass(slots=True)
class Bucket:
    tokens: float
    updated: float  # clock time of `tokens`
    full_at: float  # clock time it will have refilled to `burst`: from then on, dropping it changes nothing

    def take(self, now: float, amount: float, rate_per_s: float, burst: float) -> RateDecision:
        self.tokens = min(burst, self.tokens + max(now - self.updated, 0.0) * rate_per_s)
        self.updated = now
        if amount <= self.tokens:
            self.tokens -= amount
            decision = RateDecision(True, 0.0, self.tokens)
        elif amount > burst:
            decision = RateDecision(False, math.inf, self.tokens)
        else:
            decision = RateDecision(False, (amount - self.tokens) / rate_per_s, self.tokens)
        self.full_at = now + (burst - self.tokens) / rate_per_s
        return decision


class InProcessState(SharedState):
    """Dicts in this process, for one router. No method awaits anything, so each runs to completion
    on the event loop without interleaving: that is what makes it safe under asyncio (not threads)."""

    def __init__(self, *, max_blocks_per_worker: int = MAX_BLOCKS_PER_WORKER) -> None:
        self.max_blocks_per_worker = max_blocks_per_worker
        # Per worker, its block hashes oldest-stored first: past the cap the oldest are dropped.
        self.blocks: dict[str, OrderedDict[int, None]] = {}
        self.registry: dict[str, tuple[WorkerInfo, float]] = {}  # worker id -> (info, expiry time)
        self.buckets: dict[str, Bucket] = {}
        self.takes = 0

    async def publish_blocks(self, worker_id: str, stored: Sequence[int], evicted: Sequence[int]) -> None:
        held = self.blocks.setdefault(worker_id, OrderedDict())
        for block_hash in stored:
            held[block_hash] = None
            held.move_to_end(block_hash)
        for block_hash in evicted:
            held.pop(block_hash, None)
        while len(held) > self.max_blocks_per_worker:
            held.popitem(last=False)

    async def match(self, hashes: Sequence[int], worker_ids: Sequence[str]) -> dict[str, int]:
        empty: OrderedDict[int, None] = OrderedDict()
        return {worker: leading_run(h in self.blocks.get(worker, empty) for h in hashes) for worker in worker_ids}

    async def forget_worker(self, worker_id: str) -> None:
        self.blocks.pop(worker_id, None)

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        check_ttl(ttl_s)
        self.registry[info.worker_id] = (info, time.monotonic() + ttl_s)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        entry = self.registry.get(worker_id)
        now = time.monotonic()
        if entry is None or entry[1] <= now:
            self.registry.pop(worker_id, None)
            return False
        self.registry[worker_id] = (entry[0], now + ttl_s)
        return True

    async def deregister(self, worker_id: str) -> None:
        self.registry.pop(worker_id, None)
        self.blocks.pop(worker_id, None)

    async def workers(self, role: str | None = None) -> list[WorkerInfo]:
        now = time.monotonic()
        for worker_id in [w for w, (_, expiry) in self.registry.items() if expiry <= now]:
            del self.registry[worker_id]
        listed = sorted(self.registry.items())
        return [info for _, (info, _) in listed if role is None or info.role == role]

    async def take(self, key: str, amount: float, rate_per_s: float, burst: float) -> RateDecision:
        check_bucket(amount, rate_per_s, burst)
        now = time.monotonic()
        bucket = self.buckets.setdefault(key, Bucket(burst, now, now))
        decision = bucket.take(now, amount, rate_per_s, burst)
        self.takes += 1
        if self.takes % BUCKET_SWEEP_EVERY == 0:
            # Keys come and go (one bucket per API key and limit): forget those that have refilled.
            self.buckets = {k: b for k, b in self.buckets.items() if b.full_at > now or k == key}
        return decision

    async def close(self) -> None:
        pass


def connect_state(url: str | None) -> SharedState:
    """No URL: this process's own state. A redis:// URL: Redis, with fallbacks while it is away."""
    if not url:
        return InProcessState()
    from cluster.redis_state import RedisState  # redis loads only when configured
    from cluster.resilient_state import ResilientState

    return ResilientState(RedisState(url))
