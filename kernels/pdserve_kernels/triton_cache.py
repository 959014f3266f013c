"""Triton cache write: scatter a step's new keys and values into their slots of the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve_kernels import reference
from pdserve_kernels.triton_common import FP8_FORMATS, cache_strides, check_device, check_heads, interpreted


@triton.jit
def _write_kernel(  # noqa: PLR0913
    key, value, cache, slot_mapping,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kv, stride_slot, stride_cache_head,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    # A negative slot marks a padding token (a CUDA graph's unused rows): it has nowhere to go.
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)
    source = heads[:, None] * stride_key_head + dims[None, :]
    target = cache + slot * stride_slot + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(key + token.to(tl.int64) * stride_key_token + source, mask=mask)
    tl.store(target, k.to(cache.dtype.element_ty), mask=mask)
    source = heads[:, None] * stride_value_head + dims[None, :]
    v = tl.load(value + token.to(tl.int64) * stride_value_token + source, mask=mask)
    tl.store(target + stride_kv, v.to(cache.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter new keys and values ([tokens, kv_heads, head_dim]) into their slots; tokens whose slot
    is negative are skipped. One program per token. Into an fp8 cache they go rounded by torch's cast
    (saturated: `reference.to_cache_dtype`), as bytes."""
    stride_kv, stride_slot, stride_cache_head = cache_strides(kv_cache)
    _, _, _, kv_heads, head_dim = kv_cache.shape
    check_heads(key, "key", head_dim, kv_heads)
    check_heads(value, "value", head_dim, kv_heads)
    if slot_mapping.shape != (key.shape[0],) or value.shape[0] != key.shape[0]:
        raise ValueError(f"{key.shape[0]} keys, {value.shape[0]} values and {tuple(slot_mapping.shape)} slots")
    check_device(_write_kernel, key, value, kv_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    if kv_cache.dtype in FP8_FORMATS:
        key, value = (reference.to_cache_dtype(x, kv_cache.dtype).view(torch.uint8) for x in (key, value))
        kv_cache = kv_cache.view(torch.uint8)
    _write_kernel[(key.shape[0],)](
        key, value, kv_cache, slot_mapping, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        stride_kv, stride_slot, stride_cache_head, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def interpreter_active() -> bool:
    """Whether the kernels were decorated under TRITON_INTERPRET=1 (and so take CPU tensors)."""
    return interpreted(_write_kernel)
