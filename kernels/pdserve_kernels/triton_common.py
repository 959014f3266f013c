"""What the Triton kernels share: the checks their wrappers run before a launch, and matmul settings.

The cache layout is `reference`'s:

    kv_cache[0 = key | 1 = value, block_id, offset_in_block, kv_head, head_dim]

The kernels never use block ids and offsets apart: they address a token by its flat slot
`block_id * block_size + offset`, which needs the slots of all blocks evenly spaced (checked here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

LOG2_E = 1.4426950408889634
TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# An fp8 cache (`kv_cache_dtype`) reaches the kernels as its bytes (uint8) and this constexpr says how to
# widen them (`widen_kv`): 0 not fp8, 1 e4m3, 2 e5m2.
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def cache_operand(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cache as the kernels take it (an fp8 one as uint8) and its FP8 constexpr."""
    fp8 = FP8_FORMATS.get(kv_cache.dtype, 0)
    return (kv_cache.view(torch.uint8) if fp8 else kv_cache), fp8


@triton.jit
def widen_kv(x, FP8: tl.constexpr):
    """Keys or values as loaded, widened to float32 if they are fp8 bytes, by moving their bits into an
    fp16 (exact, as `kernels/pdserve_kernels/cpu_common.h` does): e5m2 is an fp16's top byte; e4m3's exponent and
    mantissa (sign from the sign extension, the exponent's top bit cleared) make the value times 2^-8.
    Bit moves, not fp8 types: the same on every GPU and in the interpreter."""
    if FP8 == 1:
        halves = (x.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -16512  # 0xBF80
        return halves.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    elif FP8 == 2:
        return (x.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return x


@triton.jit
def log2_scores(dots, scale_log2, SOFTCAP: tl.constexpr):
    """Scores in base 2 (the softmax's exp2) from q.k dot products: times the scale, soft-capped where
    SOFTCAP > 0 (softcap * tanh(score / softcap) on the scaled score, Gemma 2's). tanh as
    1 - 2 / (e^2x + 1): saturates to +-1 without a NaN (exp's overflow to inf gives 1), and the
    interpreter and every GPU have exp."""
    if SOFTCAP > 0:
        capped = dots * (scale_log2 / (SOFTCAP * 1.4426950408889634))
        return (1.0 - 2.0 / (tl.exp(2.0 * capped) + 1.0)) * (SOFTCAP * 1.4426950408889634)
    else:
        return dots * scale_log2


def softcap_constexpr(softcap: float | None) -> float:
    """The kernels' SOFTCAP constexpr: 0.0 for no cap."""
    return 0.0 if softcap is None else float(softcap)


def interpreted(kernel: object) -> bool:
    """Whether `kernel` runs in Triton's interpreter (TRITON_INTERPRET=1 when triton decorated it)."""
    return isinstance(kernel, InterpretedFunction)


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    device = tensors[0].device
    if any(tensor.device != device for tensor in tensors):
        raise ValueError(f"tensors on several devices: {sorted({str(t.device) for t in tensors})}")
    if device.type == "cpu" and not interpreted(kernel):
        raise ValueError("Triton kernels run on CPU tensors only in the interpreter: set TRITON_INTERPRET=1 "
                         "before triton is imported, or use the torch attention backend")


def cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int]:
    """Strides (in elements) of the cache from keys to values, from slot to slot, and from kv head to
    kv head; the head dimension must be contiguous."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache must be [2, blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}")
    block_size = kv_cache.shape[2]
    if block_size & (block_size - 1):
        raise ValueError(f"the cache's block_size must be a power of two, got {block_size}")
    if kv_cache.stride(4) != 1 or kv_cache.stride(1) != block_size * kv_cache.stride(2):
        raise ValueError(f"kv_cache strides {kv_cache.stride()} do not space slots evenly with a contiguous head_dim")
    return kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3)


def check_heads(tensor: torch.Tensor, name: str, head_dim: int, heads: int | None = None) -> None:
    """A [tokens, heads, head_dim] tensor with a contiguous head_dim."""
    if tensor.dim() != 3 or tensor.shape[2] != head_dim or (heads is not None and tensor.shape[1] != heads):
        expected = f"[tokens, {heads if heads is not None else 'heads'}, {head_dim}]"
        raise ValueError(f"{name} must be {expected}, got {tuple(tensor.shape)}")
    if tensor.stride(2) != 1:
        raise ValueError(f"{name} needs a contiguous head_dim, got strides {tensor.stride()}")


def num_warps(block_d: int) -> int:
    """Eight warps for wide heads: with four, a [64 tokens, 128 dims] tile of keys and one of values
    spill registers on sm_90 (`cuobjdump --dump-resource-usage` of the compiled attention kernels)."""
    return 8 if block_d >= 128 else 4


def dot_options(kernel: object, dtype: torch.dtype) -> dict[str, object]:
    """The constexprs that set a kernel's matmuls for a cache of `dtype`: DOT_DTYPE, what operands are
    cast to, and DOT_PRECISION, float32 exact on GPUs (no TF32).

    Triton's interpreter multiplies the bit patterns of bfloat16 operands (triton-lang/triton#11584),
    so there they are cast to float32, the same values; compiled kernels keep bfloat16 tensor cores.
    """
    upcast = interpreted(kernel) and dtype == torch.bfloat16
    return {"DOT_DTYPE": tl.float32 if upcast else TRITON_DTYPES[dtype],
            "DOT_PRECISION": "ieee" if upcast or dtype == torch.float32 else "tf32"}
