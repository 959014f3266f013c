"""Host memory for the host KV tier's slots (`cluster.engine.host_tier`), and the copies to and from
the device's paged cache.

Each layer's host tensor has the device cache's layout with slots for blocks,
[2, num_slots, block_size, kv_heads, head_dim], so a copy is one gather and one scatter per layer.
On CUDA it is pinned, so copies run at the link's speed.

On disk (`host_kv_disk_dir`), every layer's slots are one memory-mapped file: the kernel's page cache
holds the slots used lately and writes the rest back to the file, so the tier can be larger than the
host's memory. The file is unlinked as soon as it is mapped: it takes disk space while its process
lives and none after, whichever way the process ends.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache's memory as uint8 (same shape): torch's index_copy_ and index_put_ take no fp8 on CPUs."""
    return cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache


class HostKVCache:
    def __init__(self, num_slots: int, kv_caches: list[torch.Tensor], disk_dir: str = "") -> None:
        shapes = [(2, num_slots, *cache.shape[2:]) for cache in kv_caches]
        if disk_dir:
            self.caches = on_disk(disk_dir, shapes, [cache.dtype for cache in kv_caches])
            return
        pin = kv_caches[0].device.type == "cuda"
        # Unset memory: a slot is always written (offloaded) before it is read (loaded).
        self.caches = [torch.empty(shape, dtype=cache.dtype, pin_memory=pin)
                       for shape, cache in zip(shapes, kv_caches, strict=True)]

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


def on_disk(directory: str, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Tensors of these shapes and dtypes in one shared memory-mapped file made in `directory` (and
    unlinked at once: the mapping keeps its blocks until the process ends)."""
    os.makedirs(directory, exist_ok=True)
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True)]
    handle, path = tempfile.mkstemp(prefix="pdserve-host-kv-", suffix=".bin", dir=directory)
    try:
        os.ftruncate(handle, sum(sizes))  # sparse: disk blocks are taken as slots are written
        data = torch.from_file(path, shared=True, size=sum(sizes), dtype=torch.uint8)
    finally:
        os.close(handle)
        os.unlink(path)
    tensors, start = [], 0
    for shape, dtype, size in zip(shapes, dtypes, sizes, strict=True):
        tensors.append(data[start:start + size].view(dtype).view(shape))
        start += size
    return tensors
