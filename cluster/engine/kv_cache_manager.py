"""Which KV blocks each request owns, and the prefix cache lookups that let requests share them.

The scheduler asks three things: how much of a new request's prompt is already cached
(`find_cached_prefix`), whether the blocks for the tokens it wants to run fit (`allocate_slots`),
and to give everything back when a request ends or is preempted (`free`). The model runner only
sees the resulting block ids (`block_ids`), and the copies to and from the host tier
(`take_host_copies`).

A prefix is looked up in the device pool first, then, where it stops, in the host tier; blocks found
there are promoted when the request's slots are allocated: each gets a fresh device block, its KV
is copied in before the step runs, and the request's computed tokens count it like a device hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.common.block_hashes import hash_block_tokens, root_hash
from cluster.engine.block_pool import Block, BlockPool
from cluster.engine.host_tier import HostCopies
from cluster.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class CachedPrefix:
    """The cached blocks a prompt starts with: some in the device pool, then some in the host tier."""

    blocks: list[Block] = field(default_factory=list)
    host_hashes: list[int] = field(default_factory=list)  # promoted by `allocate_slots`

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) + len(self.host_hashes)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, model_name: str = "") -> None:
        self.pool = pool
        self.block_size = block_size
        self.model_name = model_name  # with each request's cache domain, the root of its chain
        self.blocks_of: dict[str, list[Block]] = {}
        # The same blocks as ids, kept in step so the runner's block tables cost nothing to read.
        self.block_ids_of: dict[str, list[int]] = {}
        # Chained hashes of each request's full blocks, extended as its tokens grow.
        self.hashes_of: dict[str, list[int]] = {}
        # How many of each request's leading blocks have been offered to the prefix cache.
        self.num_cached_of: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: read it, don't keep or change it)."""
        return self.block_ids_of.get(request_id, [])

    def find_cached_prefix(self, request: Request) -> tuple[CachedPrefix, int]:
        """The longest run of cached full blocks at the start of the request's tokens (the device
        pool's, then the host tier's), and its tokens. Changes nothing but the hit counters.

        At least one token is always left to compute, since the model must produce logits for it.
        """
        if not self.pool.enable_prefix_caching:
            return CachedPrefix(), 0
        found = CachedPrefix(blocks=self.cached_prefix_blocks(request))
        tier = self.pool.host_tier
        if tier is not None:
            max_blocks = (request.num_tokens - 1) // self.block_size
            hashes = self._block_hashes(request, max_blocks)[:max_blocks]
            for block_hash in hashes[len(found.blocks):]:
                if block_hash not in tier:
                    break
                found.host_hashes.append(block_hash)
            tier.queries += request.num_tokens - len(found.blocks) * self.block_size
            tier.hits += len(found.host_hashes) * self.block_size
        num_tokens = found.num_blocks * self.block_size
        self.prefix_queries += request.num_tokens
        self.prefix_hits += num_tokens
        return found, num_tokens

    def cached_prefix_blocks(self, request: Request) -> list[Block]:
        """The prompt's leading blocks in the device pool, uncounted (a decode worker looks before it
        decides where the prompt computes); they stay free until `allocate_slots` takes them. The host
        tier is not searched: the blocks a prefill worker would otherwise send are the device pool's."""
        if not self.pool.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.pool.cached_run(self._block_hashes(request, max_blocks)[:max_blocks])

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: CachedPrefix | None = None,
                       cache_full: bool = True) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed (and cached) ones.

        Returns False, changing nothing, when the pool cannot hold them. Full blocks are entered in
        the prefix cache as soon as they are scheduled: the runner writes every slot of a step before
        any attention reads, so a block is never read before its KV is there.
        """
        blocks = self.blocks_of.get(request.request_id, [])
        if cached is None or not cached.num_blocks:
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(blocks) * self.block_size:  # fits in the blocks it has: most decodes
                # Only the request's own tokens fill blocks for the cache, never the drafts after them;
                # a step of several tokens (accepted drafts) may cross a block boundary anywhere.
                num_real = min(num_tokens, len(request.all_token_ids))
                if self.pool.enable_prefix_caching and \
                        num_real // self.block_size > self.num_cached_of.get(request.request_id, 0):
                    self._cache_full_blocks(request, blocks, num_real)
                return True
        cached = cached or CachedPrefix()
        cached_blocks = cached.blocks
        num_tokens = request.num_computed_tokens + cached.num_blocks * self.block_size + num_new_tokens
        # Blocks promoted from the host tier are among the new ones.
        num_needed = cdiv(num_tokens, self.block_size) - len(blocks) - len(cached_blocks)
        # Cached blocks nobody owns sit in the free queue; taking them shrinks what is free.
        num_reclaimed = sum(1 for block in cached_blocks if block.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed:
            return False
        slots = self._claim(cached.host_hashes)
        self.pool.touch(cached_blocks)
        taken = self.pool.allocate(num_needed) if num_needed > 0 else []
        self._promote(cached.host_hashes, slots, taken)
        new_blocks = cached_blocks + taken
        blocks = self.blocks_of.setdefault(request.request_id, blocks)
        blocks.extend(new_blocks)
        self.block_ids_of.setdefault(request.request_id, []).extend(block.block_id for block in new_blocks)
        if cache_full:
            self._cache_full_blocks(request, blocks, min(num_tokens, request.num_tokens))
        return True

    def _claim(self, host_hashes: list[int]) -> list[int]:
        """Take the host hits out of the tier before any block is allocated: an allocation evicts
        device blocks into the tier, which must not push the hits out first."""
        tier = self.pool.host_tier
        return [tier.claim(block_hash) for block_hash in host_hashes] if tier is not None else []

    def _promote(self, host_hashes: list[int], slots: list[int], blocks: list[Block]) -> None:
        """Queue each host hit's copy into its new device block, cached under its hash at once: the
        copies run before the step, so no read comes before the KV is there."""
        tier = self.pool.host_tier
        for block_hash, slot, block in zip(host_hashes, slots, blocks[:len(host_hashes)], strict=True):
            assert tier is not None
            tier.load(slot, block.block_id)
            self.pool.cache(block, block_hash)

    def promote_run(self, hashes: list[int]) -> int:
        """Bring into the pool the host tier's blocks that go on from the pool's leading run of `hashes`
        (a chain), as many as there are free blocks for: cached and free, as if just freed, their
        copies queued (`take_host_copies`: the caller makes them before anything reads them). The
        blocks promoted (0 without a tier). For what is read outside a step: a prefix sent to a peer."""
        tier = self.pool.host_tier
        if tier is None:
            return 0
        run = self.pool.cached_run(hashes)
        self.pool.touch(run)  # no allocation below may evict the run it continues
        host_hashes: list[int] = []
        for block_hash in hashes[len(run):]:
            if block_hash not in tier or len(host_hashes) == self.pool.num_free_blocks:
                break
            host_hashes.append(block_hash)
        slots = self._claim(host_hashes)
        taken = self.pool.allocate(len(host_hashes))
        self._promote(host_hashes, slots, taken)
        self.pool.free(run + taken)
        return len(taken)

    def take_host_copies(self) -> HostCopies:
        """The copies to and from the host tier queued since the last call (none without a tier): the
        runner must make them before it next writes or reads any block."""
        tier = self.pool.host_tier
        return tier.take_copies() if tier is not None else HostCopies()

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Whether `allocate_slots(request, num_new_tokens)` (no cached prefix) would fit, changing nothing."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(self.blocks_of.get(request.request_id, []))
        return num_needed <= self.pool.num_free_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's full blocks up to `num_tokens` into the prefix cache: for blocks filled
        from outside a step (KV received from another worker), once their data is in place."""
        self._cache_full_blocks(request, self.blocks_of[request.request_id], num_tokens)

    def free(self, request: Request) -> list[int]:
        """Give back the request's blocks; returns their ids (a swap-out copies them first)."""
        blocks = self.blocks_of.pop(request.request_id, [])
        self.num_cached_of.pop(request.request_id, None)
        self.pool.free(blocks)
        if request.finished:
            self.hashes_of.pop(request.request_id, None)
        return self.block_ids_of.pop(request.request_id, [])

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        hashes = self.hashes_of.setdefault(request.request_id, [])
        size = self.block_size
        tokens = request.all_token_ids
        # The domain roots the chain: requests of two domains never find each other's blocks.
        parent = hashes[-1] if hashes else root_hash(self.model_name, request.sampling_params.cache_domain)
        for index in range(len(hashes), num_full_blocks):
            parent = hash_block_tokens(parent, tokens[index * size:(index + 1) * size])
            hashes.append(parent)
        return hashes

    def _cache_full_blocks(self, request: Request, blocks: list[Block], num_tokens: int) -> None:
        if not self.pool.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        start = self.num_cached_of.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        for index in range(start, num_full):
            self.pool.cache(blocks[index], hashes[index])
        self.num_cached_of[request.request_id] = num_full
