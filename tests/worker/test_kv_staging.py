"""KV staging between a worker's cache and the connectors: no copy on the CPU; on a GPU, device memory
handed to a connector that carries it, else pinned host memory (the CUDA half runs under the `gpu`
marker)."""

from __future__ import annotations

import pytest
import torch

from cluster.common import env
from cluster.worker.kv_staging import landing_buffer, sends_device_memory, wire_bytes


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
    for direct in (False, True):
        buffer = landing_buffer((2, 3), torch.bfloat16, torch.device("cpu"), direct)
        assert buffer.device.type == "cpu" and buffer.dtype == torch.bfloat16 and not buffer.is_pinned()


def test_a_cpu_tensor_is_host_memory_even_when_direct_is_asked() -> None:
    tensor = torch.arange(6, dtype=torch.float32)
    assert isinstance(wire_bytes(tensor, direct=True), memoryview)


@pytest.mark.parametrize("device, carries, via_host, expected", [
    ("cuda", True, "", True), ("cuda:1", True, "0", True), ("cuda", False, "", False), ("cuda", True, "1", False),
    ("cpu", True, "", False),
])
def test_device_memory_goes_to_the_connector_only_from_a_gpu_that_can_and_may(
        monkeypatch: pytest.MonkeyPatch, device: str, carries: bool, via_host: str, expected: bool) -> None:
    monkeypatch.setenv(env.KV_VIA_HOST, via_host)
    assert sends_device_memory(torch.device(device), carries) is expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_tensor_goes_through_pinned_host_memory_both_ways() -> None:
    tensor = torch.randn(4, 16, 8, device="cuda", dtype=torch.bfloat16)
    back = torch.frombuffer(bytearray(wire_bytes(tensor)), dtype=torch.bfloat16).reshape(4, 16, 8)
    assert torch.equal(back, tensor.cpu())
    buffer = landing_buffer((4, 16, 8), torch.bfloat16, torch.device("cuda"))
    assert buffer.is_pinned() and buffer.device.type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_direct_staging_stays_in_device_memory() -> None:
    tensor = torch.randn(4, 16, 8, device="cuda", dtype=torch.bfloat16)
    flat = wire_bytes(tensor, direct=True)
    assert isinstance(flat, torch.Tensor) and flat.is_cuda and flat.dtype == torch.uint8 and flat.dim() == 1
    assert flat.data_ptr() == tensor.data_ptr() and flat.nbytes == tensor.nbytes  # no copy
    assert flat.__cuda_array_interface__["typestr"] == "|u1"
    buffer = landing_buffer((4, 16, 8), torch.bfloat16, torch.device("cuda"), direct=True)
    assert buffer.is_cuda and buffer.shape == (4, 16, 8)
