"""State that router replicas share: which KV blocks each worker holds, which workers are alive, and
how much of its rate limits each API key has used.

One router keeps it in its own process (`cluster.state.in_process.InProcessState`). Replicas behind a
load balancer share it through Redis (`cluster.state.redis_state.RedisState`), wrapped in
`cluster.state.resilient.ResilientState` so that a slow or absent Redis degrades routing and rate
limiting instead of stopping them.
`cluster.state.connect.connect_state(url)` picks one. This module is the interface.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from cluster.common.roles import Role

MAX_BLOCKS_PER_WORKER = 65536  # block hashes remembered per worker (~the blocks of a 1 GiB KV pool)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a router needs to reach a worker. `address` is whatever the router dials: a Ray actor
    name, host:port. `meta` is free-form (model, KV block size, zone); not hashable, compare by ==."""

    worker_id: str
    role: str
    address: str
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in tuple(Role):
            raise ValueError(f"WorkerInfo.role is {self.role!r}: use one of {', '.join(Role)}")
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
