"""KV bytes between a worker's cache and the wire, wherever the cache lives.

On the CPU a prefill's exported blocks are sent from their own memory, and a decode worker lands
them in a host buffer that `import_kv` copies into the cache. On a GPU there are two ways:

- direct (the default where the connector `carries_device_memory`: UCX with its CUDA transports):
  the exported blocks are sent from device memory and land in a device buffer, so the only copies
  are the gather on the prefill GPU and the scatter into the decode cache;
- through the host (the loopback connector, UCX_TLS without `cuda_copy`, or PDSERVE_KV_VIA_HOST=1):
  a pinned bounce buffer on the sending side (one device-to-host copy), a pinned landing buffer on
  the receiving side (so the copy into the device cache is a fast DMA).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cluster.common import env

if TYPE_CHECKING:  # the type only: the connector's msgpack is not needed to stage bytes
    from cluster.transfer.connector import KVBytes


def sends_device_memory(device: torch.device, carries_device_memory: bool) -> bool:
    """Whether a worker whose cache is on `device` hands its connector device memory: on a GPU, when
    the connector carries it and the operator did not ask for host staging."""
    return device.type == "cuda" and carries_device_memory and os.environ.get(env.KV_VIA_HOST, "") != "1"


def wire_bytes(tensor: torch.Tensor, direct: bool = False) -> KVBytes:
    """The bytes to send for `tensor`: its own memory on the CPU (no copy when contiguous); on a GPU
    its device memory if `direct`, else a pinned host copy. The result keeps the memory alive."""
    if tensor.device.type == "cuda" and direct:
        flat = tensor.contiguous().view(torch.uint8).reshape(-1)
        # UCX reads the memory on its own stream: what the engine queued must be written first.
        torch.cuda.current_stream(tensor.device).synchronize()
        return flat
    host = tensor if tensor.device.type == "cpu" else to_pinned_host(tensor)
    return memoryview(host.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor in pinned host memory, complete when this returns."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host


def landing_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, direct: bool = False,
                   shared: Callable[[int], memoryview | None] | None = None) -> torch.Tensor:
    """Memory a decode worker receives a prompt's KV into, before `import_kv` writes it into a cache
    on `device`: on that GPU if `direct`, else host memory (pinned when the cache is on a GPU). For
    a CPU cache, `shared(nbytes)` may give the memory: the receiver's shared-memory segment, which a
    sender on the same host writes straight into."""
    if device.type == "cuda" and direct:
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    memory = shared(nbytes) if shared is not None and device.type == "cpu" and nbytes else None
    if memory is not None:
        return torch.frombuffer(memory, dtype=dtype).view(shape)
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
