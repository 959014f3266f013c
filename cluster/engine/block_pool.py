"""The pool of KV cache blocks: a free list, reference counts and the prefix cache.

A block is in exactly one of three conditions:
- in use: `ref_count > 0`, owned by one or more requests (shared prefix blocks have several owners);
- cached: `ref_count == 0` but `block_hash` set: free, yet still holding a full block of KV that a
  later request with the same prefix can pick up again;
- empty: `ref_count == 0`, no hash.

Free blocks (cached or empty) sit in one LRU queue. New blocks are taken from its front, which evicts
the least recently freed cached block. Requests free their blocks tail first, so the end of a
prompt (least likely to be shared) is evicted before its beginning.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    # Hash of this block's tokens chained with all blocks before it; set once the block is full.
    block_hash: int | None = None


@dataclass(slots=True)
class CacheEvents:
    """Hashes of blocks that entered and left the prefix cache, in order (see `record_events`)."""

    stored: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # Insertion order is eviction order: front = least recently freed.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        self.events: CacheEvents | None = None  # see `record_events`

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[Block]:
        """Take `count` free blocks (evicting cached ones as needed), each with ref_count 1."""
        if count > len(self.free_queue):
            raise ValueError(f"asked for {count} blocks, only {len(self.free_queue)} free")
        taken = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def lookup(self, block_hash: int) -> Block | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[Block]) -> None:
        """Add an owner to blocks found in the prefix cache, taking them off the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one owner from each block; blocks nobody owns go to the back of the free queue."""
        for block in reversed(blocks):
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed more times than it was taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                if not self.enable_prefix_caching:
                    block.block_hash = None
                self.free_queue[block.block_id] = block

    def cache(self, block: Block, block_hash: int) -> None:
        """Record a full block under its chained hash (first writer wins: duplicates stay private)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            if self.events is not None:
                self.events.stored.append(block_hash)

    def record_events(self) -> None:
        """From now on keep the hashes of blocks cached and evicted, for `take_events` (a worker
        publishes them so routers know which prefixes it holds)."""
        if self.events is None:
            self.events = CacheEvents()

    def take_events(self) -> CacheEvents:
        """The events since the last call (empty if not recording)."""
        if self.events is None:
            return CacheEvents()
        taken, self.events = self.events, CacheEvents()
        return taken

    def reset_prefix_cache(self) -> None:
        for block in list(self.free_queue.values()):
            self._evict(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.evicted.append(block.block_hash)
        block.block_hash = None
