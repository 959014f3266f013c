"""Fused elementwise ops for CPUs (`cpu_fused.c`), called through ctypes: the residual add with the
RMSNorm after it, SiLU(gate) * up, the rotary embedding of queries and keys, the step's KV write
into the paged cache, the masked softmax of a bf16 prefill chunk, and the greedy argmax over bf16
logits.

At a decode step's rows each torch op costs more in dispatch than in arithmetic, and the model runs
dozens of them per layer between its matmuls; here each group is one call. Compiled at first use
(`kernels/pdserve_kernels/cpu_build.py`); `available(dtype)` is False where no compiler works or the
dtype is neither fp32 nor bf16, and the model keeps its torch ops. The results round where the torch
ops round (see the C file), so the two paths agree to the order of a sum;
`tests/kernels/test_cpu_fused.py` holds them to it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve_kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_fused.c")
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
FP8_CODES = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}  # write_kv_fp8's `e5m2` argument
ISA_NAMES = {0: "plain C", 1: "AVX-512", 2: "AVX-512 + AVX512-BF16"}

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "add_rms_norm": (_P, _P, _P, _P, _P, _I64, _I64, _F, _INT),
    "silu_mul": (_P, _P, _I64, _I64, _INT),
    "rotary": (_P, _I64, _P, _P, _P, _I64, _I64, _I64, _INT),
}


@functools.cache
def library(march: str = "native") -> ctypes.CDLL | None:
    """The kernels built for `march` ("native": this CPU), with their signatures declared."""
    lib = cpu_build.load(SOURCE, march)
    if lib is None:
        return None
    for name, signature in _SIGNATURES.items():
        for suffix in SUFFIXES.values():
            function = getattr(lib, f"{name}_{suffix}")
            function.argtypes, function.restype = signature, None
    lib.causal_softmax_bf16.argtypes, lib.causal_softmax_bf16.restype = (_P, _I64, _I64, _I64, _I64, _INT), _INT
    lib.argmax_rows_bf16.argtypes, lib.argmax_rows_bf16.restype = (_P, _I64, _I64, _I64, _P, _INT), None
    lib.write_kv.argtypes, lib.write_kv.restype = (_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64), _INT
    lib.write_kv_fp8.argtypes = (_P, _I64, _P, _I64, _INT, _INT, _P, _P, _I64, _I64, _I64)
    lib.write_kv_fp8.restype = _INT
    lib.fused_isa.restype = ctypes.c_int
    return lib


def available(dtype: torch.dtype, march: str = "native") -> bool:
    return dtype in SUFFIXES and library(march) is not None


def isa(march: str = "native") -> str:
    """The instruction sets the build for `march` uses (tests check an AVX2 build takes plain C)."""
    lib = library(march)
    return "none" if lib is None else ISA_NAMES[lib.fused_isa()]


def _lib(march: str) -> ctypes.CDLL:
    lib = library(march)
    if lib is None:
        raise RuntimeError("the CPU fused kernels are not available here: check `available(dtype)` first")
    return lib


def _check(*tensors: torch.Tensor) -> None:
    """The kernels trust their pointers: CPU, contiguous, one supported dtype."""
    dtype = tensors[0].dtype
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dtype != dtype or dtype not in SUFFIXES:
            raise ValueError("the CPU fused kernels take contiguous CPU tensors of one dtype, float32 or bfloat16")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 march: str = "native") -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual) over the last dim of x [rows, size]; without a
    residual, (weight * rms_norm(x), x)."""
    _check(x, weight, *([] if residual is None else [residual]))
    size = x.shape[-1]
    if weight.shape != (size,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"weight {tuple(weight.shape)} or residual does not fit x {tuple(x.shape)}")
    out = torch.empty_like(x)
    summed = x if residual is None else torch.empty_like(x)
    getattr(_lib(march), f"add_rms_norm_{SUFFIXES[x.dtype]}")(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        summed.data_ptr(), x.numel() // size if size else 0, size, eps, torch.get_num_threads())
    return out, summed


def silu_mul(gate_up: torch.Tensor, march: str = "native") -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * size] holding gate then up in each row."""
    _check(gate_up)
    size = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], size))
    getattr(_lib(march), f"silu_mul_{SUFFIXES[gate_up.dtype]}")(
        gate_up.data_ptr(), out.data_ptr(), out.numel() // size if size else 0, size, torch.get_num_threads())
    return out


def rotary(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
           march: str = "native") -> torch.Tensor:
    """The first `heads` heads of each row of qkv [rows, >= heads * head_dim] (rows contiguous, the row
    stride free) rotated: [rows, heads, head_dim]. cos and sin: [rows, head_dim / 2] float32."""
    rows = qkv.shape[0]
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < heads * head_dim or head_dim % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {heads} heads of {head_dim} in contiguous rows")
    cos, sin = cos.reshape(rows, head_dim // 2), sin.reshape(rows, head_dim // 2)
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous float32 [rows, head_dim / 2]")
    if qkv.device.type != "cpu" or qkv.dtype not in SUFFIXES:
        raise ValueError("the CPU fused kernels take CPU tensors of float32 or bfloat16")
    out = qkv.new_empty((rows, heads, head_dim))
    getattr(_lib(march), f"rotary_{SUFFIXES[qkv.dtype]}")(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows, heads, head_dim,
        torch.get_num_threads())
    return out


def causal_softmax_(scores: torch.Tensor, visible: int, repeat: int = 1, march: str = "native") -> torch.Tensor:
    """scores [rows, cols] bf16 in place: row i the softmax of its first `visible + i // repeat` entries
    (at most cols), the others 0. Returns scores."""
    _check(scores)
    if scores.dtype != torch.bfloat16 or scores.dim() != 2 or visible < 1 or repeat < 1:
        raise ValueError("causal_softmax_ takes [rows, cols] bfloat16 scores, visible >= 1 and repeat >= 1")
    rows, cols = scores.shape
    if _lib(march).causal_softmax_bf16(scores.data_ptr(), rows, cols, visible, repeat, torch.get_num_threads()):
        raise MemoryError("the causal softmax kernel could not allocate a row of scores")
    return scores


def argmax_rows(logits: torch.Tensor, march: str = "native") -> torch.Tensor:
    """torch.argmax(logits.float(), dim=-1) for bf16 logits [rows, cols] (rows may be strided), without
    widening them: torch's own bf16 argmax is not vectorized on CPUs (slower than widening first)."""
    if logits.dtype != torch.bfloat16 or logits.dim() != 2 or logits.stride(1) != 1 or logits.device.type != "cpu":
        raise ValueError("argmax_rows takes CPU bfloat16 logits [rows, cols] with contiguous rows")
    rows, cols = logits.shape
    if cols == 0:
        raise ValueError("argmax_rows needs at least one column")
    out = torch.empty(rows, dtype=torch.int64)
    _lib(march).argmax_rows_bf16(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr(),
                                 torch.get_num_threads())
    return out


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   march: str = "native") -> None:
    """`reference.write_kv_cache` in one call: key and value [tokens, kv_heads, head_dim] of the cache's
    dtype, or fp32/bf16 for an fp8 cache (rounded as `reference.to_cache_dtype` rounds, on the way in),
    each token's heads contiguous (rows may be strided: views into the step's qkv), into the slots of
    slot_mapping (int64). An out-of-range slot raises IndexError and writes nothing."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    row = kv_heads * head_dim
    to_fp8 = kv_cache.dtype in FP8_CODES
    for x in (key, value):
        fits = x.shape == (slot_mapping.shape[0], kv_heads, head_dim) and x.stride(2) == 1 and x.stride(1) == head_dim
        dtype_fits = x.dtype in SUFFIXES if to_fp8 else x.dtype == kv_cache.dtype
        if not dtype_fits or x.dtype != key.dtype or x.device.type != "cpu" or not fits:
            raise ValueError(f"key/value {tuple(x.shape)} {x.dtype} do not fit the cache's rows of {kv_heads} x "
                             f"{head_dim} {kv_cache.dtype} (dtype and shape; each row's heads contiguous)")
    if not kv_cache.is_contiguous() or kv_cache.device.type != "cpu" or slot_mapping.dtype != torch.int64:
        raise ValueError("kv_cache must be a contiguous CPU tensor and slot_mapping int64")
    slots = slot_mapping.contiguous()
    size = key.element_size()
    strides = (key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size)
    if to_fp8:
        failed = _lib(march).write_kv_fp8(*strides, int(key.dtype == torch.bfloat16), FP8_CODES[kv_cache.dtype],
                                          kv_cache.data_ptr(), slots.data_ptr(), slots.shape[0], row,
                                          num_blocks * block_size)
    else:
        failed = _lib(march).write_kv(*strides, kv_cache.data_ptr(), slots.data_ptr(), slots.shape[0], row * size,
                                      num_blocks * block_size)
    if failed:
        raise IndexError(f"a KV slot lies outside the cache's {num_blocks * block_size} slots")
