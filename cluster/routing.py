"""How the router picks workers: by load, and prefill workers also by the prompt prefix they hold.

Decode workers are ranked by requests the router has in flight there, then their waiting queue and
free KV blocks as last polled (`WorkerLoad`, every `LOAD_POLL_S`). A prefill worker is ranked by the
prompt tokens it still has to compute: those in flight there, plus this prompt less the prefix it
probably has cached. "Probably": `PrefixIndex` remembers which block-aligned prompt prefixes went to
which worker (bounded, least recently used forgotten first), as SGLang's cache-aware router does,
without asking the workers.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from cluster.worker import WorkerLoad

LOAD_POLL_S = 0.5
PREFIXES_PER_WORKER = 65536  # block hashes remembered per worker (~the blocks of a 1 GiB KV pool)


def prefix_hashes(prompt: Sequence[int], block_size: int) -> list[int]:
    """One chained hash per full block of the prompt: equal hashes mean equal prefixes up to there."""
    hashes, parent = [], b""
    for start in range(0, len(prompt) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=8)
        digest.update(b"".join(token.to_bytes(4, "little") for token in prompt[start:start + block_size]))
        parent = digest.digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


class PrefixIndex:
    """Per worker, the block hashes of the prompts sent there recently."""

    def __init__(self, capacity: int = PREFIXES_PER_WORKER) -> None:
        self.capacity = capacity
        self.seen: dict[Hashable, OrderedDict[int, None]] = {}

    def overlap(self, worker: Hashable, hashes: list[int]) -> int:
        """How many leading blocks of the prompt the worker has seen."""
        seen = self.seen.get(worker)
        if seen is None:
            return 0
        count = 0
        for block_hash in hashes:
            if block_hash not in seen:
                break
            count += 1
        return count

    def record(self, worker: Hashable, hashes: list[int]) -> None:
        seen = self.seen.setdefault(worker, OrderedDict())
        for block_hash in hashes:
            seen[block_hash] = None
            seen.move_to_end(block_hash)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def forget(self, worker: Hashable) -> None:
        self.seen.pop(worker, None)


def decode_rank(in_flight: int, load: WorkerLoad | None) -> tuple[int, int, int]:
    """Lower is better: fewer requests here, fewer waiting, more free blocks."""
    if load is None:
        return in_flight, 0, 0
    return in_flight, load.num_waiting, -load.num_free_blocks


def prefill_cost(queued_tokens: int, prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """Prompt tokens the worker computes before this one is done (its queue, then the uncached part)."""
    return queued_tokens + max(prompt_tokens - cached_blocks * block_size, 0)
