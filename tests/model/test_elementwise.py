"""The model's elementwise ops pick the fused C kernels for CPU tensors they serve and the torch ops
of `kernels/pdserve_kernels/reference` otherwise (non-contiguous rows, fp16, `use_c_kernels` off), with one result."""

from __future__ import annotations

import pytest
import torch

from cluster.model import elementwise
from pdserve_kernels import cpu_fused, reference

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



@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_an_fp8_cache_is_written_by_the_c_kernel_rounded_and_saturated_as_torch_does(
        monkeypatch: pytest.MonkeyPatch, fp8: torch.dtype) -> None:
    """Keys and values rounded to fp8 by torch's cast (values past fp8's largest saturate there, none
    becomes inf), then written in one C call: the bytes `reference.write_kv_cache` writes. The keys are
    a strided view of qkv rows, as the model hands them over."""
    qkv = torch.randn(5, 12, 64).bfloat16() * 4
    qkv[0, 6, :4] = torch.tensor([1e5, -1e5, 500.0, -0.0])  # past e5m2's and e4m3's largest, and -0
    key, value = qkv[:, 6:9], qkv[:, 9:]
    slots = torch.tensor([9, 2, 7, 0, 4])
    calls, real = [], cpu_fused.write_kv_cache
    monkeypatch.setattr(cpu_fused, "write_kv_cache", lambda *args: calls.append(args) or real(*args))
    got, expected = torch.zeros(2, 3, 4, 3, 64, dtype=fp8), torch.zeros(2, 3, 4, 3, 64, dtype=fp8)
    elementwise.write_kv_cache(key, value, got, slots)
    assert len(calls) == 1
    reference.write_kv_cache(key, value, expected, slots)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert got.float().isfinite().all() and got[0, 2, 1, 0, 0].float() == reference.FP8_MAX[fp8]
