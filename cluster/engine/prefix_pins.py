"""Blocks pinned for a prefix fetched from a peer: a worker can take the beginning of a prompt's KV
from another worker that caches it, over the KV transfer, instead of computing it again.

Three steps, each on its own worker's engine thread, the router between them (`docs/ray_cluster.md`):

    donor (holds the prefix)                      fetcher (a prefill worker about to compute it)
    ------------------------                      ---------------------------------------------
    offer(fetch id, hashes, first, stop)
      pins its cached blocks [first, k): k - first
                                                  reserve(fetch id, hashes, first, k - first)
                                                    pins its own blocks [0, first), takes k - first
                                                    fresh ones for the KV to land in
    export(fetch id): reads the offered blocks,
      unpins them; sent to the fetcher's ticket
                                                  land(fetch id, KV): writes it, caches each fresh
                                                    block under its hash
                                                  the prompt's prefill finds them cached; release

Every pin ends in `release` (or `export` for an offer), whatever happens, or when its lease runs out
(`expire`): a router that died between the steps leaks nothing. Blocks are pinned by an owner count
in the pool, as a request's are: the pool evicts none of them meanwhile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from cluster.engine.block_pool import Block, BlockPool


@dataclass(slots=True)
class Pin:
    blocks: list[Block]  # one owner count each is this pin's
    landing: list[Block]  # the fetcher's fresh blocks, the tail of `blocks`; [] for an offer
    hashes: list[int]  # the landing blocks' hashes, in order
    deadline: float  # time.monotonic() after which `expire` releases it


class PrefixPins:
    """The pins of prefix transfers in flight on one engine, by fetch id."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.pins: dict[str, Pin] = {}
        # Since start: blocks this engine sent to peers, and blocks it received from them.
        self.blocks_offered = 0
        self.blocks_landed = 0

    def offer(self, fetch_id: str, hashes: list[int], first_block: int, lease_s: float) -> int:
        """Pin the cached blocks of a prompt's blocks `first_block` onwards (`hashes`: the prompt's
        chain from its first block), up to the first one this pool does not hold; how many (0: none,
        nothing pinned). The chain names every block before `first_block` too: no need to hold those."""
        self._check_new(fetch_id)
        blocks = self.pool.cached_run(hashes[first_block:])
        if blocks:
            self.pool.touch(blocks)
            self.pins[fetch_id] = Pin(blocks, [], [], time.monotonic() + lease_s)
        return len(blocks)

    def take_offer(self, fetch_id: str) -> list[int]:
        """The offered blocks' ids, to read before `release` (KeyError when the offer is gone)."""
        return [block.block_id for block in self.pins[fetch_id].blocks]

    def reserve(self, fetch_id: str, hashes: list[int], first_block: int, num_blocks: int,
                lease_s: float) -> list[int] | None:
        """Pin this pool's own blocks [0, first_block) of the prompt and take `num_blocks` fresh ones
        after them for the peer's KV; their ids, or None (pinning nothing) when this pool does not
        hold the blocks before them (the fetched ones would be unreachable) or has no room."""
        self._check_new(fetch_id)
        held = self.pool.cached_run(hashes[:first_block])
        reclaimed = sum(1 for block in held if block.ref_count == 0)
        if len(held) < first_block or num_blocks > self.pool.num_free_blocks - reclaimed:
            return None
        self.pool.touch(held)
        landing = self.pool.allocate(num_blocks)
        self.pins[fetch_id] = Pin(held + landing, landing, hashes[first_block:first_block + num_blocks],
                                  time.monotonic() + lease_s)
        return [block.block_id for block in landing]

    def landed(self, fetch_id: str) -> None:
        """The peer's KV is in the landing blocks: enter each in the prefix cache under its hash."""
        pin = self.pins[fetch_id]
        for block, block_hash in zip(pin.landing, pin.hashes, strict=True):
            self.pool.cache(block, block_hash)
        self.blocks_landed += len(pin.landing)

    def release(self, fetch_id: str, sent: bool = False) -> None:
        """Drop the pin's owner counts (nothing if it is gone already): cached blocks stay cached,
        landing blocks whose KV never came go back empty. `sent`: an offer's blocks left for a peer."""
        pin = self.pins.pop(fetch_id, None)
        if pin is None:
            return
        if sent:
            self.blocks_offered += len(pin.blocks)
        self.pool.free(pin.blocks)

    def expire(self, now: float | None = None) -> None:
        """Release the pins whose lease ran out (their transfer never finished or was never asked)."""
        now = time.monotonic() if now is None else now
        for fetch_id in [fetch_id for fetch_id, pin in self.pins.items() if pin.deadline <= now]:
            self.release(fetch_id)

    def _check_new(self, fetch_id: str) -> None:
        self.expire()  # an idle engine steps no more: its stale pins end here
        if fetch_id in self.pins:
            raise ValueError(f"fetch id {fetch_id!r} is already in use")
