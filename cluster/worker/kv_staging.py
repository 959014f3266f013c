"""KV bytes between a worker's cache and the wire, wherever the cache lives.

The connectors move host memory (`memoryview`s). On the CPU a prefill's exported blocks are sent
from their own memory and a decode worker lands them in a host buffer that `import_kv` copies into
the cache. On a GPU the blocks go through pinned host memory both ways: a bounce buffer on the
sending side (one device-to-host copy), a pinned landing buffer on the receiving side (so the copy
into the device cache is a fast DMA). Sending straight from device memory (UCX's CUDA transports)
would save those two copies; it needs a CUDA-aware send path and is not done.
"""

from __future__ import annotations

import torch


def wire_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes to send for `tensor`: its own memory on the CPU (no copy when contiguous), a pinned
    host copy of it on a GPU. The view keeps the memory it reads alive."""
    host = tensor if tensor.device.type == "cpu" else to_pinned_host(tensor)
    return memoryview(host.contiguous().view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor in pinned host memory, complete when this returns."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensor.device).synchronize()
    return host


def landing_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory a decode worker receives a prompt's KV into, before `import_kv` writes it into a
    cache on `device`: pinned when that is a GPU."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
