"""Which KV blocks each request owns, and the prefix cache lookups that let requests share them.

The scheduler asks three things: how much of a new request's prompt is already cached
(`find_cached_prefix`), whether the blocks for the tokens it wants to run fit (`allocate_slots`),
and to give everything back when a request ends or is preempted (`free`). The model runner only
sees the resulting block ids (`block_ids`).
"""

from __future__ import annotations

from cluster.common.block_hashes import hash_block_tokens, root_hash
from cluster.engine.block_pool import Block, BlockPool
from cluster.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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

    def find_cached_prefix(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached full blocks at the start of the request's tokens.

        At least one token is always left to compute, since the model must produce logits for it.
        """
        if not self.pool.enable_prefix_caching:
            return [], 0
        hits = self.cached_prefix_blocks(request)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def cached_prefix_blocks(self, request: Request) -> list[Block]:
        """`find_cached_prefix`'s blocks, uncounted (a decode worker looks before it decides where the
        prompt computes); the blocks stay free until `allocate_slots` takes them."""
        if not self.pool.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in self._block_hashes(request, max_blocks)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[Block] | None = None,
                       cache_full: bool = True) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed (and cached) ones.

        Returns False, changing nothing, when the pool cannot hold them. Full blocks are entered in
        the prefix cache as soon as they are scheduled: the runner writes every slot of a step before
        any attention reads, so a block is never read before its KV is there.
        """
        blocks = self.blocks_of.get(request.request_id, [])
        if not cached_blocks:
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(blocks) * self.block_size:  # fits in the blocks it has: most decodes
                # Only the request's own tokens fill blocks for the cache, never the drafts after them;
                # a step of several tokens (accepted drafts) may cross a block boundary anywhere.
                num_real = min(num_tokens, len(request.all_token_ids))
                if self.pool.enable_prefix_caching and \
                        num_real // self.block_size > self.num_cached_of.get(request.request_id, 0):
                    self._cache_full_blocks(request, blocks, num_real)
                return True
        cached_blocks = cached_blocks or []
        num_tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(blocks) - len(cached_blocks)
        # Cached blocks nobody owns sit in the free queue; taking them shrinks what is free.
        num_reclaimed = sum(1 for block in cached_blocks if block.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed:
            return False
        self.pool.touch(cached_blocks)
        new_blocks = cached_blocks + (self.pool.allocate(num_needed) if num_needed > 0 else [])
        blocks = self.blocks_of.setdefault(request.request_id, blocks)
        blocks.extend(new_blocks)
        self.block_ids_of.setdefault(request.request_id, []).extend(block.block_id for block in new_blocks)
        if cache_full:
            self._cache_full_blocks(request, blocks, min(num_tokens, request.num_tokens))
        return True

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
