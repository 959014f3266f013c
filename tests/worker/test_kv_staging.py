"""KV staging between a worker's cache and the connectors: no copy on the CPU, pinned host memory
for a GPU cache (the CUDA half runs under the `gpu` marker)."""

from __future__ import annotations

import pytest
import torch

from cluster.worker.kv_staging import landing_buffer, wire_bytes


def test_a_contiguous_cpu_tensor_is_sent_from_its_own_memory() -> None:
    tensor = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    view = wire_bytes(tensor)
    assert view.nbytes == tensor.numel() * 4
    tensor[0, 0, 0] = 42.0  # the view reads the tensor's memory: no copy was made
    assert torch.frombuffer(bytearray(view), dtype=torch.float32)[0] == 42.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_bytes_are_the_tensors_in_order(dtype: torch.dtype) -> None:
    tensor = torch.randn(3, 5, 2).to(dtype)[:, ::2]  # non-contiguous: sent as a contiguous copy
    back = torch.frombuffer(bytearray(wire_bytes(tensor)), dtype=dtype).reshape(3, 3, 2)
    assert torch.equal(back, tensor)


def test_a_cpu_cache_lands_in_plain_host_memory() -> None:
    buffer = landing_buffer((2, 3), torch.bfloat16, torch.device("cpu"))
    assert buffer.device.type == "cpu" and buffer.dtype == torch.bfloat16 and not buffer.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_tensor_goes_through_pinned_host_memory_both_ways() -> None:
    tensor = torch.randn(4, 16, 8, device="cuda", dtype=torch.bfloat16)
    back = torch.frombuffer(bytearray(wire_bytes(tensor)), dtype=torch.bfloat16).reshape(4, 16, 8)
    assert torch.equal(back, tensor.cpu())
    buffer = landing_buffer((4, 16, 8), torch.bfloat16, torch.device("cuda"))
    assert buffer.is_pinned() and buffer.device.type == "cpu"
