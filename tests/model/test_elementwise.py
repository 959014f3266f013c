"""The model's elementwise ops pick the fused C kernels for CPU tensors they serve and the torch ops
of `kernels/reference` otherwise (non-contiguous rows, fp16, `use_c_kernels` off), with one result."""

from __future__ import annotations

import pytest
import torch

from cluster.model import elementwise
from kernels import cpu_fused, reference

pytestmark = pytest.mark.skipif(not cpu_fused.available(torch.bfloat16), reason="no C compiler on this machine")


def test_cpu_tensors_of_fp32_and_bf16_take_the_c_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    assert elementwise.uses_c_kernels(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert elementwise.uses_c_kernels(torch.zeros(2, 8))
    assert not elementwise.uses_c_kernels(torch.zeros(2, 8, dtype=torch.float16))
    monkeypatch.setattr(elementwise, "use_c_kernels", False)
    assert not elementwise.uses_c_kernels(torch.zeros(2, 8))


def test_cpu_bf16_takes_the_c_kernel_and_torch_ops_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    x, residual = torch.randn(64, 576).bfloat16(), torch.randn(64, 576).bfloat16()
    weight = torch.rand(576).bfloat16()
    fused = elementwise.add_rms_norm(x, residual, weight, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(fused, cpu_fused.add_rms_norm(x, residual, weight, 1e-5),
                                                 strict=True)), "the C kernel's result, bit for bit"
    monkeypatch.setattr(elementwise, "use_c_kernels", False)
    torch_ops = elementwise.add_rms_norm(x, residual, weight, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(torch_ops, reference.add_rms_norm(x, residual, weight, 1e-5),
                                                 strict=True))
    torch.testing.assert_close(fused[0], torch_ops[0], atol=1e-2, rtol=8e-3)


def test_what_the_kernels_do_not_serve_takes_the_torch_ops() -> None:
    gate_up = torch.randn(8, 64).half()  # fp16: no C kernel
    assert torch.equal(elementwise.silu_mul(gate_up), reference.silu_mul(gate_up))
    strided = torch.randn(64, 8).bfloat16().T  # rows not contiguous
    weight = torch.rand(64).bfloat16()
    assert torch.equal(elementwise.add_rms_norm(strided, None, weight, 1e-5)[0],
                       reference.rms_norm(strided, weight, 1e-5))


def test_the_kv_write_takes_the_c_kernel_where_it_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same cache either way; fp16 and a key in another dtype than the cache take torch's index_copy_."""
    key, value = torch.randn(5, 3, 64).bfloat16(), torch.randn(5, 3, 64).bfloat16()
    slots = torch.tensor([9, 2, 7, 0, 4])
    calls, real = [], cpu_fused.write_kv_cache
    monkeypatch.setattr(cpu_fused, "write_kv_cache", lambda *args: calls.append(args) or real(*args))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got, expected = torch.zeros(2, 3, 4, 3, 64, dtype=dtype), torch.zeros(2, 3, 4, 3, 64, dtype=dtype)
        elementwise.write_kv_cache(key, value, got, slots)
        reference.write_kv_cache(key, value, expected, slots)
        assert torch.equal(got, expected)
    assert len(calls) == 1, "only the bf16 cache (the keys' own dtype) takes the C kernel"

