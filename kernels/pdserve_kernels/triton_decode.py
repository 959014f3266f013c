"""Triton decode attention over the paged KV cache: one query token per sequence (flash-decoding).

One program attends one sequence's GQA group (every query head that shares a kv head) over one
split of its context, so each key and value is read once for the whole group:

    grid (sequence, kv_head, split)        split s covers positions [s * L, (s + 1) * L) of the
    q      [BLOCK_H >= group, BLOCK_D]     sequence, L = cdiv(seq_len / splits) rounded up to
    scores [BLOCK_H, BLOCK_N] per tile     whole tiles of BLOCK_N tokens; tiles gather their
                                           tokens slot by slot through the block table

With one split the program normalizes and writes the output itself. With several (split-K, for
batches too small to fill the GPU) each writes its normalized partial output and log-sum-exp,
and a second kernel combines the splits of each (sequence, head) weighted by exp(lse - max lse).
Softmax runs in base 2 (scores pre-scaled by log2 e) and in float32 whatever the cache dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve_kernels.reference import CAUSAL, AttentionOptions
from pdserve_kernels.triton_common import (
    FP8_FORMATS,
    LOG2_E,
    cache_operand,
    cache_strides,
    check_device,
    check_heads,
    dot_options,
    log2_scores,
    num_warps,
    softcap_constexpr,
    widen_kv,
)

MAX_SPLITS = 32
# A split shorter than this spends more on its partial result than it saves in parallelism.
MIN_TOKENS_PER_SPLIT = 256


@functools.lru_cache
def _parallel_programs(device: torch.device) -> int:
    """Programs in flight that keep the device's memory busy: a few per SM on CUDA. The interpreter
    runs programs one after another, where splitting only adds work."""
    if device.type != "cuda":
        return 1
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split the context only when batch x kv_heads programs leave the device idle, never into
    pieces shorter than MIN_TOKENS_PER_SPLIT; a power of two, so few kernel variants exist."""
    wanted = min(-(-_parallel_programs(device) // max(batch * num_kv_heads, 1)),
                 -(-max_seq_len // MIN_TOKENS_PER_SPLIT), MAX_SPLITS)
    return 1 if wanted <= 1 else 1 << (wanted - 1).bit_length()


@triton.jit
def _decode_split_kernel(  # noqa: PLR0913
    query, cache, block_tables, seq_lens, out, partial_out, partial_lse, scale_log2, num_splits, window,
    stride_query_token, stride_query_head, stride_kv, stride_slot, stride_cache_head, stride_table,
    stride_out_token, stride_out_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    # A sliding window (window > 0) shows the query its context's last `window` tokens: the splits
    # share those alone. Whole tiles per split: only the last tile is ragged.
    first = tl.maximum(seq_len - window, 0) if window > 0 else 0
    split_len = ((seq_len - first + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q = tl.load(query + seq * stride_query_token + heads[:, None] * stride_query_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)
    keys = cache + kv_head * stride_cache_head
    table = block_tables + seq * stride_table

    top = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        valid = positions < end
        pages = tl.load(table + positions // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        offsets = (pages * PAGE_SIZE + positions % PAGE_SIZE)[:, None] * stride_slot + dims[None, :]
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = widen_kv(tl.load(keys + offsets, mask=kv_mask, other=0), FP8).to(DOT_DTYPE)
        scores = log2_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale_log2, SOFTCAP)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        p = tl.exp2(scores - new_top[:, None])
        alpha = tl.exp2(top - new_top)
        v = widen_kv(tl.load(keys + stride_kv + offsets, mask=kv_mask, other=0), FP8).to(DOT_DTYPE)
        # Probabilities round to the query's dtype (the model's): the tensor-core matmul takes both alike.
        p_v = tl.dot(p.to(query.dtype.element_ty).to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + p_v
        total = total * alpha + tl.sum(p, 1)
        top = new_top

    # An empty split (or a padding row with seq_len 0) has total 0: it contributes zeros, not NaNs.
    empty = total == 0.0
    acc = acc / tl.where(empty, 1.0, total)[:, None]
    store_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        num_heads = tl.num_programs(1) * GROUP
        partial = (seq * num_heads + heads) * num_splits + split
        tl.store(partial_out + partial[:, None] * HEAD_DIM + dims[None, :], acc, mask=store_mask)
        lse = top + tl.log2(tl.where(empty, 1.0, total))
        tl.store(partial_lse + partial, tl.where(empty, float("-inf"), lse), mask=row_mask)
    else:
        tl.store(out + seq * stride_out_token + heads[:, None] * stride_out_head + dims[None, :],
                 acc.to(out.dtype.element_ty), mask=store_mask)


@triton.jit
def _decode_reduce_kernel(  # noqa: PLR0913
    partial_out, partial_lse, out, num_splits, stride_out_token, stride_out_head,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    first = (seq * tl.num_programs(1) + head) * num_splits
    lse = tl.load(partial_lse + first + splits, mask=split_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    acc = tl.load(partial_out + (first + splits)[:, None] * HEAD_DIM + dims[None, :],
                  mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(weights, 0)
    result = tl.sum(weights[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out + seq * stride_out_token + head * stride_out_head + dims, result.to(out.dtype.element_ty),
             mask=dims < HEAD_DIM)


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,  # noqa: PLR0913
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           options: AttentionOptions = CAUSAL, *,
                           out: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Like `reference.paged_decode_attention`: query [batch, heads, head_dim], one token per sequence
    over its `seq_lens` cached tokens (the last `options.window` of them where it slides, and scores
    soft-capped by `options.softcap`). `max_seq_len` only sizes the split-K choice (`num_splits`,
    default `choose_num_splits`, over the window where it is narrower); `out` may be a view to write
    into. A sequence of length 0 gets zeros."""
    stride_kv, stride_slot, stride_cache_head = cache_strides(kv_cache)
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    check_heads(query, "query", head_dim)
    batch, num_heads = query.shape[0], query.shape[1]
    out = torch.empty_like(query) if out is None else out
    _check(query, kv_cache, block_tables, seq_lens, out)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    if batch == 0:
        return out
    visible = max_seq_len if options.window is None else min(max_seq_len, options.window)
    splits = num_splits or choose_num_splits(batch, num_kv_heads, visible, query.device)
    # Tiles of 16 tokens in the interpreter (CPUs): the tests' short contexts then cross several.
    tile = 64 if query.is_cuda else 16
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    partial_out = partial_lse = out  # unused placeholders when there is one split
    if splits > 1:
        partial_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=query.device)
    cache, fp8 = cache_operand(kv_cache)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        query, cache, block_tables, seq_lens, out, partial_out, partial_lse, scale * LOG2_E, splits,
        options.window or 0, query.stride(0), query.stride(1), stride_kv, stride_slot, stride_cache_head,
        block_tables.stride(0), out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        SPLIT=splits > 1,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=tile,
        **dot_options(_decode_split_kernel, query.dtype), FP8=fp8, SOFTCAP=softcap_constexpr(options.softcap),
        num_warps=num_warps(block_d))
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            partial_out, partial_lse, out, splits, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4)
    return out


def _check(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           out: torch.Tensor) -> None:
    batch = query.shape[0]
    if query.dtype != kv_cache.dtype and kv_cache.dtype not in FP8_FORMATS:
        raise ValueError(f"query is {query.dtype} but the cache holds {kv_cache.dtype}")
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match query {tuple(query.shape)} {query.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{batch}, max_blocks] with contiguous rows, got "
                         f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
    if seq_lens.shape != (batch,) or (batch > 1 and seq_lens.stride(0) != 1):
        raise ValueError(f"seq_lens must be [{batch}] contiguous, got {tuple(seq_lens.shape)}")
    if block_tables.dtype.is_floating_point or seq_lens.dtype.is_floating_point:
        raise ValueError("block_tables and seq_lens must hold integers")
    check_device(_decode_split_kernel, query, kv_cache, block_tables, seq_lens, out)
