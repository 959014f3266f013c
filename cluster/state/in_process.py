"""The shared state kept in one process: what a single router (or gateway) uses when no Redis URL is
configured. Same semantics as the Redis implementation, which the same tests check."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.state.interface import (
    MAX_BLOCKS_PER_WORKER,
    RateDecision,
    SharedState,
    WorkerInfo,
    check_bucket,
    check_ttl,
    leading_run,
)

BUCKET_SWEEP_EVERY = 4096  # takes between sweeps of the in-process buckets that have refilled


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

