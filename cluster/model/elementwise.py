"""The model's elementwise ops between its matmuls, each either one fused C kernel (CPU tensors of
fp32 or bf16 where the kernels build: `pdserve_kernels/cpu_fused.c`) or the torch ops of `pdserve_kernels.reference`
(GPUs, fp16, no compiler). `use_c_kernels` set False gives the torch ops everywhere: the benchmarks
compare both in one run. docs/engine.md has the why and docs/performance.md the figures."""

from __future__ import annotations

import torch

from pdserve_kernels import cpu_fused, reference

use_c_kernels = True


def uses_c_kernels(x: torch.Tensor) -> bool:
    """Whether the ops on x take the C kernels: a CPU tensor of a dtype they serve, and they build here."""
    return use_c_kernels and x.device.type == "cpu" and cpu_fused.available(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual): the residual add and the next norm in one pass."""
    if uses_c_kernels(x) and x.is_contiguous() and (residual is None or residual.is_contiguous()) \
            and weight.dtype == x.dtype:
        return cpu_fused.add_rms_norm(x, residual, weight, eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if uses_c_kernels(gate_up) and gate_up.is_contiguous():
        return cpu_fused.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def rotate_heads(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The first `heads` heads of each row of qkv [tokens, ...] rotated: [tokens, heads, head_dim]."""
    if uses_c_kernels(qkv) and qkv.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous():
        return cpu_fused.rotary(qkv, heads, head_dim, cos, sin)
    return reference.rotary(qkv[:, :heads * head_dim].view(-1, heads, head_dim), cos, sin)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The step's keys and values [tokens, kv_heads, head_dim] into their cache slots: one C call where
    each row's heads are contiguous and the rows are in the cache's dtype, or in fp32/bf16 for an fp8
    cache (rounded to it on the way in); else torch's cast and index_copy_."""
    rows_fit = all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (key, value))
    dtype_fits = key.dtype == value.dtype and (key.dtype == kv_cache.dtype or kv_cache.dtype.itemsize == 1)
    if uses_c_kernels(key) and kv_cache.is_contiguous() and rows_fit and dtype_fits:
        cpu_fused.write_kv_cache(key, value, kv_cache, slot_mapping)
    else:
        reference.write_kv_cache(key, value, kv_cache, slot_mapping)
