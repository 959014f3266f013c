"""The second KV tier: full blocks the device pool evicted, kept in host memory by their hashes.

The tier is exclusive of the device pool's prefix cache: a block the pool evicts moves here (its
KV copied out before the block is reused), and a prefix hit here moves the block back into a
fresh device block (copied in before the step that reads it). Only bookkeeping lives here, no
tensors: the tier decides which host slot each hash occupies and queues the copies, and the model
runner makes them (`cluster.model.host_kv`) at the start of the next forward pass.

Copies of one step run in two phases, every offload before every load, so that:
- an offload reads a device block before a load (or the step itself) writes it;
- a slot a load reads is not written by an offload of the same step: slots given up by a
  promotion are reused only once the step's copies were taken (`take_copies`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class HostCopies:
    """The copies to make before a step's forward pass: offloads (device block -> host slot), then
    loads (host slot -> device block)."""

    offload_blocks: list[int] = field(default_factory=list)
    offload_slots: list[int] = field(default_factory=list)
    load_slots: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offload_blocks or self.load_blocks)


class HostTier:
    """An LRU of block hash -> host slot, `num_slots` slots."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # front = least recently offloaded
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.released: list[int] = []  # slots promoted out this step: free once the copies are taken
        self.copies = HostCopies()
        self.queries = 0  # prompt tokens looked up here: those past the device pool's hits
        self.hits = 0  # of those, tokens found here
        self.offloaded = 0  # blocks copied out of the device pool
        self.promoted = 0  # blocks copied back in

    @property
    def num_used(self) -> int:
        return len(self.slot_of)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_slots

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.slot_of

    def offload(self, block_hash: int, block_id: int) -> int | None:
        """Take in a block the device pool evicts; returns the hash this drops for room, if any (a
        hash already here only becomes the most recent: its KV is the same)."""
        if block_hash in self.slot_of:
            self.slot_of.move_to_end(block_hash)
            return None
        dropped = None
        if not self.free_slots:
            if not self.slot_of:  # every slot was promoted out this step: no room until they are free
                return block_hash
            dropped, slot = self.slot_of.popitem(last=False)
            self.free_slots.append(slot)
        slot = self.free_slots.pop()
        self.slot_of[block_hash] = slot
        self.copies.offload_blocks.append(block_id)
        self.copies.offload_slots.append(slot)
        self.offloaded += 1
        return dropped

    def claim(self, block_hash: int) -> int:
        """Take a hash out of the tier for a promotion: its slot, to `load` from once a device block
        is taken for it. Claimed before that block is taken, since taking it may evict (and offload)
        blocks, which must not push the hash out first."""
        slot = self.slot_of.pop(block_hash)
        self.released.append(slot)
        return slot

    def load(self, slot: int, block_id: int) -> None:
        """Queue the copy of a claimed slot into its device block."""
        self.copies.load_slots.append(slot)
        self.copies.load_blocks.append(block_id)
        self.promoted += 1

    def take_copies(self) -> HostCopies:
        """The copies queued since the last call, for the runner to make now, in order."""
        taken, self.copies = self.copies, HostCopies()
        self.free_slots.extend(self.released)
        self.released.clear()
        return taken

    def clear(self) -> list[int]:
        """Drop everything (the queued copies too); returns the hashes dropped."""
        dropped = list(self.slot_of)
        self.slot_of.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self.released.clear()
        self.copies = HostCopies()
        return dropped
