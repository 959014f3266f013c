"""How much of a CUDA device's memory the KV cache may take (vLLM's `gpu_memory_utilization`).

An engine may use `gpu_memory_utilization` of its device's total memory. After the weights load, one
forward pass over a step of `max_num_batched_tokens` tokens (the largest a step computes) measures
the activations' peak; the KV cache takes the rest, less a margin:

    kv = utilization * total - weights - peak activations - margin

Memory other processes use is not in the sum: two engines on one GPU split it by their utilizations
(each worker sharing a GPU gets its share: docs/ray_cluster.md), and an engine that finds less
free than its share at start is refused at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from cluster.model.attention.backend import AttentionMetadata

GIB = 2**30
# Left out of the KV cache for what the profiled step does not show: the decode CUDA graphs' memory
# pools (captured later, on the first decode steps) and the caching allocator's fragmentation.
MARGIN_BYTES = 256 * 2**20


class DeviceMemory(Protocol):
    """What the sizing asks of a device. `CudaMemory` on GPUs; tests pass their own numbers."""

    def free_and_total(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as the driver counts them (every process's use)."""
        ...

    def peak_during(self, run: Callable[[], object]) -> int:
        """Run `run`; the most bytes it held at once beyond what was allocated when it began."""
        ...


class CudaMemory:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def free_and_total(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def peak_during(self, run: Callable[[], object]) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()  # the step's blocks back to the device, before the KV cache is allocated
        return int(peak)


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """One engine's share of its device, as measured after loading and the profiled step."""

    utilization: float
    total: int  # the device's memory
    weights: int
    peak_activations: int
    margin: int = MARGIN_BYTES

    @property
    def kv_cache_bytes(self) -> int:
        """What the KV cache may take; refused where nothing is left, with what to change."""
        budget = int(self.utilization * self.total)
        left = budget - self.weights - self.peak_activations - self.margin
        if left <= 0:
            raise ValueError(
                f"gpu_memory_utilization {self.utilization:g} gives this engine {budget / GIB:.2f} GiB of the "
                f"device's {self.total / GIB:.2f}: the weights take {self.weights / GIB:.2f}, a step of "
                f"max_num_batched_tokens tokens {self.peak_activations / GIB:.2f} and the margin "
                f"{self.margin / GIB:.2f}, which leaves nothing for the KV cache; raise gpu_memory_utilization, "
                "lower max_num_batched_tokens, or use a smaller model or dtype")
        return left

    def describe(self) -> str:
        return (f"KV cache {self.kv_cache_bytes / GIB:.2f} GiB = {self.utilization:g} x {self.total / GIB:.2f} GiB "
                f"- weights {self.weights / GIB:.2f} - activations {self.peak_activations / GIB:.2f} "
                f"- margin {self.margin / GIB:.2f}")


def check_free(utilization: float, free: int, total: int) -> None:
    """Refuse at start an engine whose share is not free: other processes (another engine sharing the
    GPU) hold more than 1 - utilization of it."""
    if free < utilization * total:
        raise ValueError(
            f"the device has {free / GIB:.2f} GiB free of {total / GIB:.2f} and gpu_memory_utilization "
            f"{utilization:g} asks for {utilization * total / GIB:.2f}: lower gpu_memory_utilization, or free "
            "the memory other processes hold (engines sharing a GPU need utilizations that add up to at most 1)")


def profile_metadata(num_tokens: int, max_len: int, block_size: int,
                     device: torch.device) -> tuple[AttentionMetadata, torch.Tensor, int]:
    """A step of `num_tokens` new prompt tokens, in sequences of at most `max_len` over blocks 0..:
    its attention metadata, the positions, and the blocks it writes."""
    lengths = [min(max_len, num_tokens - start) for start in range(0, num_tokens, max_len)]
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    blocks_each = -(-max(lengths) // block_size)
    tables = torch.arange(len(lengths) * blocks_each, dtype=torch.int64).view(len(lengths), blocks_each)
    positions = torch.cat([torch.arange(length) for length in lengths])
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    slots = tables[rows, positions // block_size] * block_size + positions % block_size
    metadata = AttentionMetadata(
        slot_mapping=slots.to(device), block_tables=tables.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device), num_decodes=0,
        max_seq_len=max(lengths), seq_lens_list=lengths, query_start_list=starts)
    return metadata, positions.to(device), tables.numel()
