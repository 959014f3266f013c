"""Paged decode attention for CPUs as a small C kernel (`cpu_decode.c`), called through ctypes.

The torch path (`torch_decode`) gathers every sequence's blocks into a dense tensor per layer and
step, then runs small batched matmuls: five passes over the context's keys and values and a dozen op
launches. The C kernel reads each key and value once, straight from the paged cache, with one task
per sequence spread over torch's intra-op threads (OpenMP: torch's own runtime, shared by soname).

It is compiled at first use for the machine's own CPU (`kernels/pdserve_kernels/cpu_build.py`: a second or two,
once per machine). Where no compiler works,
`available()` is False and the torch backend keeps the torch path. fp32 and bf16 caches, and fp8 e5m2
caches (e5m2 and e4m3: `kv_cache_dtype`) under an fp32 or bf16 model: each byte widened to fp32 as it is read.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve_kernels import cpu_build, reference

SOURCE = Path(__file__).with_name("cpu_decode.c")
TOO_LONG = 2  # the kernel's answer when a length exceeds its block table: nothing read
# By (query dtype, cache dtype): the model's dtype for both, or an fp8 e5m2 cache (`kv_cache_dtype`).
FUNCTIONS = {(torch.float32, torch.float32): "paged_decode_f32", (torch.bfloat16, torch.bfloat16): "paged_decode_bf16",
             (torch.float32, torch.float8_e5m2): "paged_decode_f32_e5m2",
             (torch.bfloat16, torch.float8_e5m2): "paged_decode_bf16_e5m2",
             (torch.float32, torch.float8_e4m3fn): "paged_decode_f32_e4m3",
             (torch.bfloat16, torch.float8_e4m3fn): "paged_decode_bf16_e4m3"}


class DecodeShape(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("block_size", ctypes.c_int64), ("num_blocks", ctypes.c_int64),
                ("table_stride", ctypes.c_int64), ("scale", ctypes.c_float), ("num_threads", ctypes.c_int),
                ("tiled", ctypes.c_int), ("query_stride", ctypes.c_int64), ("table_width", ctypes.c_int64),
                ("window", ctypes.c_int64), ("softcap", ctypes.c_float)]


@functools.cache
def _library(march: str = "native") -> ctypes.CDLL | None:
    """The kernel built for `march` ("native": this CPU; tests also build for CPUs without AVX-512 or
    AVX512-BF16, whose code paths differ)."""
    library = cpu_build.load(SOURCE, march)
    if library is not None:
        for name in FUNCTIONS.values():
            getattr(library, name).restype = ctypes.c_int
    return library


def available(dtype: torch.dtype, march: str = "native") -> bool:
    """Whether the C kernel serves a cache of this dtype on this machine (compiling it if need be)."""
    return any(dtype == cache for _, cache in FUNCTIONS) and _library(march) is not None


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,  # noqa: PLR0913
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           options: reference.AttentionOptions = reference.CAUSAL,
                           march: str = "native", *, tiled: bool = True) -> torch.Tensor:
    """One query token per sequence ([batch, heads, head_dim]) over its cached context (its window's
    last tokens where `options` slides one: the blocks before the window are never read); a
    sequence of length 0 (a padding row) gives zeros. `max_seq_len` is unused: each sequence reads
    its own length. Same contract as `reference.paged_decode_attention`. `tiled` False takes the
    one-token loop even where the build and head size allow 16 tokens at a time (cpu_decode.c), the
    loop every other CPU and head size runs: the tests check both, `benchmarks.engine decode-kernel`
    times both."""
    library = _library(march)
    if library is None or not available(kv_cache.dtype, march):
        raise RuntimeError("the CPU decode kernel is not available here: check `available(dtype)` first")
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    batch, heads, _ = query.shape
    _check(query, kv_cache, block_tables, seq_lens)
    # The query's rows may be strided (a view into the step's rotated q + k): only each row's heads
    # must lie contiguous, as they do there.
    rows_contiguous = query.stride(2) == 1 and query.stride(1) == head_dim
    # The cache's dtype, or over an fp8 cache the query's (fp16 and the like computed in fp32).
    query_dtype = kv_cache.dtype if kv_cache.dtype.itemsize > 1 else \
        query.dtype if query.dtype in (torch.float32, torch.bfloat16) else torch.float32
    q = query if query.dtype == query_dtype and rows_contiguous else query.to(query_dtype).contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()  # no copy where it is already
    out = q.new_empty((batch, heads, head_dim))
    shape = DecodeShape(batch, heads, kv_heads, head_dim, block_size, num_blocks, tables.stride(0) if batch else 0,
                        scale, torch.get_num_threads(), int(tiled), q.stride(0) if batch else 0,
                        tables.shape[1], options.window or 0, options.softcap or 0.0)
    failed = getattr(library, FUNCTIONS[query_dtype, kv_cache.dtype])(
        ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(kv_cache.data_ptr()), ctypes.c_void_p(tables.data_ptr()),
        ctypes.c_void_p(lens.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.byref(shape))
    if failed == TOO_LONG:
        raise ValueError("a sequence is longer than its block table covers (or its length is negative)")
    if failed:
        raise MemoryError("the CPU decode kernel could not allocate its scratch memory")
    return out.to(query.dtype)




def _check(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """The kernel trusts its pointers: shapes, devices and index types are checked here."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    if not kv_cache.is_contiguous() or kv_cache.device.type != "cpu":
        raise ValueError("kv_cache must be a contiguous CPU tensor")
    if query.dim() != 3 or query.shape[2] != head_dim or query.shape[1] % kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit a cache of {kv_heads} KV heads x {head_dim}")
    if block_tables.dtype != torch.int64 or block_tables.shape[0] != query.shape[0]:
        raise ValueError("block_tables must be int64 with one row per query")
    if seq_lens.shape != (query.shape[0],):
        raise ValueError("seq_lens must hold one length per query")
    # Each length against its table's width is checked by the kernel itself, before it reads anything:
    # here it cost a `max` and a sync to Python per layer (every layer of a step passes the same ones).
