"""The pool of KV cache blocks: a free list, reference counts and the prefix cache.

A block is in exactly one of three conditions:
- in use: `ref_count > 0`, owned by one or more requests (shared prefix blocks have several owners);
- cached: `ref_count == 0` but `block_hash` set: free, yet still holding a full block of KV that a
  later request with the same prefix can pick up again;
- empty: `ref_count == 0`, no hash.

Free blocks (cached or empty) sit in one LRU queue. New blocks are taken from its front, which evicts
the least recently freed cached block. Requests free their blocks tail first, so the end of a
prompt (least likely to be shared) is evicted before its beginning.

With a host tier (`cluster.engine.host_tier`), an evicted cached block is not lost: its hash and KV
move to host memory, and the pool's events report it evicted only when the tier drops it, since until
then the worker still holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from cluster.engine.host_tier import HostTier


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

    def store(self, block_hash: int) -> None:
        # The index applies every stored hash before the evicted ones: a hash evicted, then stored
        # again, must not stay among the evicted (a store, then an eviction, reads right as it is).
        if block_hash in self.evicted:
            self.evicted.remove(block_hash)
        self.stored.append(block_hash)


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True, host_tier: HostTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # Insertion order is eviction order: front = least recently freed.
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, Block] = {}
        self.events: CacheEvents | None = None  # see `record_events`
        self.host_tier = host_tier if enable_prefix_caching else None

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

    def cached_run(self, hashes: list[int]) -> list[Block]:
        """The cached blocks of a chain of hashes from its start, up to the first one not cached."""
        run = []
        for block_hash in hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            run.append(block)
        return run

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
                self.events.store(block_hash)

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

    def held_hashes(self) -> list[int]:
        """Every hash this worker can serve a prefix from: the device cache's, then the host tier's."""
        in_host = list(self.host_tier.slot_of) if self.host_tier is not None else []
        return [*self.cached, *(block_hash for block_hash in in_host if block_hash not in self.cached)]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in the host tier too (nothing is offloaded)."""
        for block in list(self.free_queue.values()):
            self._evict(block, offload=False)
        if self.host_tier is not None:
            for block_hash in self.host_tier.clear():
                self._report_evicted(block_hash)

    def _evict(self, block: Block, offload: bool = True) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        block.block_hash = None
        if self.cached.get(block_hash) is not block:
            return  # a private duplicate: nothing was cached under it
        del self.cached[block_hash]
        if offload and self.host_tier is not None:
            dropped = self.host_tier.offload(block_hash, block.block_id)
            if dropped is not None:
                self._report_evicted(dropped)
        else:
            self._report_evicted(block_hash)

    def _report_evicted(self, block_hash: int) -> None:
        """A hash left this worker (a copy in the other tier keeps it held)."""
        held = block_hash in self.cached or (self.host_tier is not None and block_hash in self.host_tier)
        if self.events is not None and not held:
            self.events.evicted.append(block_hash)
