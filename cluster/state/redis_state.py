"""Shared state in Redis, so that router replicas agree (`cluster.state.resilient` serves without it).

Key layout (`prefix` is "pdserve" unless given):

    <prefix>:blocks:<worker_id>   set of the block hashes the worker holds, 16 bytes each. Past
                                  max_blocks_per_worker random members are dropped; the key expires
                                  blocks_ttl_s after the worker's last publish or heartbeat.
    <prefix>:worker:<worker_id>   string: the WorkerInfo as JSON, expiring ttl_s after the last register
                                  or heartbeat, on Redis's clock (so replicas agree on who expired).
    <prefix>:workers              set of worker ids that may be registered; ids whose key expired are
                                  removed by whichever replica lists workers next.
    <prefix>:rate:<blake2b(key)>  hash {tokens, s, us}: a token bucket as of Redis TIME s.us; expires
                                  once it would have refilled anyway. The key is hashed: API keys are
                                  secrets, and Redis lists its keys to anyone who asks.

A Redis restart loses all of it: heartbeats answer False, so workers register again (`ResilientState`
does it for those registered through it), the block index refills as workers publish, buckets start
full.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from typing import cast

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from cluster.common.block_hashes import HASH_BYTES
from cluster.state.interface import (
    MAX_BLOCKS_PER_WORKER,
    RateDecision,
    SharedState,
    WorkerInfo,
    check_bucket,
    check_ttl,
)

# Atomic token bucket on Redis's clock. KEYS[1]: the bucket. ARGV: amount, rate per second, burst.
# Returns {allowed (0 or 1), tokens left, seconds until `amount` is there (-1: never)}; numbers go back
# as strings, since Redis truncates Lua numbers to integers.
TOKEN_BUCKET_LUA = """
local amount, rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local now = redis.call('TIME')
local state = redis.call('HMGET', KEYS[1], 'tokens', 's', 'us')
local tokens = burst
if state[1] then
  local elapsed = (tonumber(now[1]) - tonumber(state[2])) + (tonumber(now[2]) - tonumber(state[3])) / 1e6
  tokens = math.min(burst, tonumber(state[1]) + math.max(elapsed, 0) * rate)
end
local allowed, wait = 0, 0
if amount <= tokens then
  tokens = tokens - amount
  allowed = 1
elseif amount > burst then
  wait = -1
else
  wait = (amount - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 's', now[1], 'us', now[2])
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {allowed, string.format('%.17g', tokens), string.format('%.17g', wait)}
"""

# Block hashes travel as one string of 16-byte little-endian words (`pack_hashes`) and are stored so:
# encoding hundreds of ints one by one costs the router more CPU than the whole round trip.
UNPACK_LUA = """
local function hashes(packed, first, last)
  local members = {}
  for i = first, math.min(last, #packed / 16) do members[#members + 1] = string.sub(packed, 16 * i - 15, 16 * i) end
  return members
end
"""

# KEYS[1]: the worker's blocks. ARGV: stored, evicted (packed), the cap, the ttl in ms. Atomic, so the
# cap holds; past it random members go (a lost eviction event must not leave blocks forever).
PUBLISH_LUA = UNPACK_LUA + """
for first = 1, #ARGV[1] / 16, 1024 do redis.call('SADD', KEYS[1], unpack(hashes(ARGV[1], first, first + 1023))) end
for first = 1, #ARGV[2] / 16, 1024 do redis.call('SREM', KEYS[1], unpack(hashes(ARGV[2], first, first + 1023))) end
local excess = redis.call('SCARD', KEYS[1]) - tonumber(ARGV[3])
if excess > 0 then redis.call('SPOP', KEYS[1], excess) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 0
"""

# For each worker's blocks (KEYS), how many of the hashes (ARGV[1], packed, in chain order) it holds
# before the first it lacks. One round trip whatever the number of workers; SMISMEMBER by chunks
# of 128, cut out once and shared by all workers, stops soon after a worker's first miss.
MATCH_LUA = UNPACK_LUA + """
local chunks, counts = {}, {}
for k, key in ipairs(KEYS) do
  local count, missed = 0, false
  for first = 1, #ARGV[1] / 16, 128 do
    chunks[first] = chunks[first] or hashes(ARGV[1], first, first + 127)
    for _, flag in ipairs(redis.call('SMISMEMBER', key, unpack(chunks[first]))) do
      if flag == 0 then missed = true break end
      count = count + 1
    end
    if missed then break end
  end
  counts[k] = count
end
return counts
"""

# Unlists the ids (ARGV) whose info key (KEYS[2..]) has expired. In a script, so that a worker that
# registers again between a replica's read and its cleanup is not unlisted by mistake.
UNLIST_EXPIRED_LUA = """
for i, worker_id in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then redis.call('SREM', KEYS[1], worker_id) end
end
return 0
"""


def encode_info(info: WorkerInfo) -> str:
    return json.dumps({"worker_id": info.worker_id, "role": info.role, "address": info.address, "meta": info.meta})


log = logging.getLogger(__name__)


def decode_info(text: str) -> WorkerInfo:
    fields = json.loads(text)
    return WorkerInfo(fields["worker_id"], fields["role"], fields["address"], dict(fields.get("meta", {})))


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Unsigned 128-bit ints (as `block_hashes.prefix_hashes` makes them), 16 little-endian bytes
    each; anything else raises OverflowError."""
    return b"".join(h.to_bytes(HASH_BYTES, "little") for h in hashes)


def milliseconds(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


class RedisState(SharedState):
    """`timeout_s` bounds each connect and each reply; redis-py retries once at once (a pooled
    connection may predate a Redis restart), never with its default backoff of up to seconds."""

    def __init__(self, url: str, *, timeout_s: float = 0.1, prefix: str = "pdserve", blocks_ttl_s: float = 600.0,
                 max_blocks_per_worker: int = MAX_BLOCKS_PER_WORKER, max_connections: int = 64) -> None:
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1), decode_responses=True)
        self.redis = Redis(connection_pool=pool)
        self.prefix = prefix
        self.blocks_ttl_ms = milliseconds(blocks_ttl_s)
        self.max_blocks_per_worker = max_blocks_per_worker
        self.token_bucket = self.redis.register_script(TOKEN_BUCKET_LUA)
        self.publish_script = self.redis.register_script(PUBLISH_LUA)
        self.match_script = self.redis.register_script(MATCH_LUA)
        self.unlist_expired = self.redis.register_script(UNLIST_EXPIRED_LUA)
        self.malformed: set[tuple[str, str]] = set()  # worker records found not to decode, logged once

    def blocks_key(self, worker_id: str) -> str:
        return f"{self.prefix}:blocks:{worker_id}"

    def worker_key(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def members_key(self) -> str:
        return f"{self.prefix}:workers"

    def rate_key(self, key: str) -> str:
        return f"{self.prefix}:rate:{hashlib.blake2b(key.encode(), digest_size=16).hexdigest()}"

    async def publish_blocks(self, worker_id: str, stored: Sequence[int], evicted: Sequence[int]) -> None:
        args: list[bytes | int] = [pack_hashes(stored), pack_hashes(evicted), self.max_blocks_per_worker,
                                   self.blocks_ttl_ms]
        await self.publish_script(keys=[self.blocks_key(worker_id)], args=args)

    async def match(self, hashes: Sequence[int], worker_ids: Sequence[str]) -> dict[str, int]:
        if not hashes or not worker_ids:
            return dict.fromkeys(worker_ids, 0)
        counts = await self.match_script(keys=[self.blocks_key(w) for w in worker_ids], args=[pack_hashes(hashes)])
        return {worker_id: int(count) for worker_id, count in zip(worker_ids, counts, strict=True)}

    async def forget_worker(self, worker_id: str) -> None:
        await self.redis.delete(self.blocks_key(worker_id))

    async def register(self, info: WorkerInfo, ttl_s: float) -> None:
        check_ttl(ttl_s)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.worker_key(info.worker_id), encode_info(info), px=milliseconds(ttl_s))
            pipe.sadd(self.members_key, info.worker_id)
            pipe.pexpire(self.blocks_key(info.worker_id), self.blocks_ttl_ms)
            await pipe.execute()

    async def heartbeat(self, worker_id: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.pexpire(self.worker_key(worker_id), milliseconds(ttl_s))
            pipe.pexpire(self.blocks_key(worker_id), self.blocks_ttl_ms)
            listed, _ = await pipe.execute()
        return bool(listed)

    async def deregister(self, worker_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.worker_key(worker_id), self.blocks_key(worker_id))
            pipe.srem(self.members_key, worker_id)
            await pipe.execute()

    async def workers(self, role: str | None = None) -> list[WorkerInfo]:
        # Replies are str, not bytes: the pool decodes them.
        worker_ids = sorted(cast(set[str], await self.redis.smembers(self.members_key)))
        if not worker_ids:
            return []
        texts = cast(list[str | None], await self.redis.mget([self.worker_key(w) for w in worker_ids]))
        expired = [w for w, text in zip(worker_ids, texts, strict=True) if text is None]
        if expired:
            await self.unlist_expired(keys=[self.members_key, *map(self.worker_key, expired)], args=expired)
        infos = [info for worker_id, text in zip(worker_ids, texts, strict=True)
                 if text is not None and (info := self._decoded(worker_id, text)) is not None]
        return [info for info in infos if role is None or info.role == role]

    def _decoded(self, worker_id: str, text: str) -> WorkerInfo | None:
        """A worker's record, or None where it is not one (written by something else, or another
        version): skipped, logged once per record, so that one bad record hides no other worker."""
        try:
            return decode_info(text)
        except (ValueError, KeyError, TypeError) as error:
            if (worker_id, text) not in self.malformed:
                self.malformed.add((worker_id, text))
                log.warning("skipping the malformed worker record %s: %r (%.80s)", self.worker_key(worker_id),
                            error, text)
            return None

    async def take(self, key: str, amount: float, rate_per_s: float, burst: float) -> RateDecision:
        check_bucket(amount, rate_per_s, burst)
        allowed, tokens, wait = await self.token_bucket(keys=[self.rate_key(key)], args=[amount, rate_per_s, burst])
        retry_after_s = math.inf if float(wait) < 0 else float(wait)
        return RateDecision(bool(allowed), retry_after_s, float(tokens))

    async def close(self) -> None:
        await self.redis.aclose(close_connection_pool=True)

