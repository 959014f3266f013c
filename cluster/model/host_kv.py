"""Host memory for the host KV tier's slots (`cluster.engine.host_tier`), and the copies to and from
the device's paged cache.

Each layer's host tensor has the device cache's layout with slots for blocks,
[2, num_slots, block_size, kv_heads, head_dim], so a copy is one gather and one scatter per layer.
On CUDA it is pinned, so copies run at the link's speed.
"""

from __future__ import annotations

import torch


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache's memory as uint8 (same shape): torch's index_copy_ and index_put_ take no fp8 on CPUs."""
    return cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache


class HostKVCache:
    def __init__(self, num_slots: int, kv_caches: list[torch.Tensor]) -> None:
        pin = kv_caches[0].device.type == "cuda"
        # Unset memory: a slot is always written (offloaded) before it is read (loaded).
        self.caches = [torch.empty((2, num_slots, *cache.shape[2:]), dtype=cache.dtype, pin_memory=pin)
                       for cache in kv_caches]

    @property
    def num_slots(self) -> int:
        return self.caches[0].shape[1]

    def offload(self, kv_caches: list[torch.Tensor], block_ids: list[int], slots: list[int]) -> None:
        """Device blocks -> host slots (blocks about to be reused: this must run before they are written)."""
        if not block_ids:
            return
        blocks = torch.tensor(block_ids, device=kv_caches[0].device)
        index = torch.tensor(slots)
        for host, cache in zip(map(as_bytes, self.caches), map(as_bytes, kv_caches), strict=True):
            host.index_copy_(1, index, cache.index_select(1, blocks).to("cpu"))

    def load(self, kv_caches: list[torch.Tensor], slots: list[int], block_ids: list[int]) -> None:
        """Host slots -> device blocks (promoted blocks: before any attention reads them)."""
        if not block_ids:
            return
        device = kv_caches[0].device
        blocks = torch.tensor(block_ids, device=device)
        index = torch.tensor(slots)
        for host, cache in zip(map(as_bytes, self.caches), map(as_bytes, kv_caches), strict=True):
            cache.index_copy_(1, blocks, host.index_select(1, index).to(device))
