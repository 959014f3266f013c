"""Triton prefill/extend attention over the paged KV cache: variable-length causal attention for every
prefill sequence of a step in one launch.

It runs after the step's cache write, so a sequence's cached prefix and its new tokens are both in
the cache and one loop over the block table covers them:

    grid (sequence, head, query tile)    a sequence with q new tokens out of seq_len has its
                                         query i at position context + i (context = seq_len - q)
    positions  0 ........ context ........... seq_len
    keys       [ cached prefix | new tokens ]
    query i    sees positions <= context + i

A program takes BLOCK_M of its sequence's new tokens for one query head and runs an online softmax
over key tiles of BLOCK_N positions up to the last one its tile can see; tiles past a sequence's
query length exit at once (the grid is sized by the longest query of the step).
"""

from __future__ import annotations

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


@triton.jit
def _prefill_kernel(  # noqa: PLR0913
    query, cache, block_tables, seq_lens, query_start_loc, out, scale_log2, window,
    stride_query_token, stride_query_head, stride_kv, stride_slot, stride_cache_head, stride_table,
    stride_out_token, stride_out_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Deepest tiles (the most keys to see) first, so that the grid ends on light programs.
    first_row = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    query_start = tl.load(query_start_loc + seq)
    query_len = tl.load(query_start_loc + seq + 1) - query_start
    if first_row >= query_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - query_len

    rows = first_row + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < query_len
    dim_mask = dims < HEAD_DIM
    tokens = (query_start + rows).to(tl.int64)
    q = tl.load(query + tokens[:, None] * stride_query_token + head * stride_query_head + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(DOT_DTYPE)
    keys = cache + (head // GROUP) * stride_cache_head
    table = block_tables + seq * stride_table
    last_visible = context + rows  # the last position each query row may attend to

    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum(seq_len, context + first_row + BLOCK_M)
    # Under a sliding window (window > 0) row r sees (last_visible[r] - window, last_visible[r]]: the
    # tiles start at the tile's first row's first visible position.
    begin = tl.maximum(context + first_row - window + 1, 0) if window > 0 else 0
    for tile in range(begin, end, BLOCK_N):
        positions = tile + tl.arange(0, BLOCK_N)
        valid = positions < end
        pages = tl.load(table + positions // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        offsets = (pages * PAGE_SIZE + positions % PAGE_SIZE)[:, None] * stride_slot + dims[None, :]
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = widen_kv(tl.load(keys + offsets, mask=kv_mask, other=0), FP8).to(DOT_DTYPE)
        scores = log2_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale_log2, SOFTCAP)
        visible = valid[None, :] & (positions[None, :] <= last_visible[:, None])
        if window > 0:
            visible = visible & (positions[None, :] > last_visible[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        # A row that has seen nothing yet (a window's rows start at different positions) keeps -inf
        # as its max: exp2 against 0 instead gives it zeros rather than NaNs.
        base = tl.where(new_top == float("-inf"), 0.0, new_top)
        p = tl.exp2(scores - base[:, None])
        alpha = tl.exp2(top - base)
        v = widen_kv(tl.load(keys + stride_kv + offsets, mask=kv_mask, other=0), FP8).to(DOT_DTYPE)
        # Probabilities round to the query's dtype (the model's): the tensor-core matmul takes both alike.
        p_v = tl.dot(p.to(query.dtype.element_ty).to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + p_v
        total = total * alpha + tl.sum(p, 1)
        top = new_top

    # Rows past the query (never stored) may have seen nothing under a window: no 0 / 0 for them.
    acc = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out + tokens[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
             acc.to(out.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,  # noqa: PLR0913
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                            scale: float, options: AttentionOptions = CAUSAL, *,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its context (the keys inside the sliding
    window of `options`, if any, scores soft-capped by its `softcap`), all sequences at once.

    query/out [tokens, heads, head_dim]; sequence i's new tokens are rows
    `query_start_loc[i]:query_start_loc[i + 1]` of `query` and `out` (the rows need not start at 0:
    a mixed batch passes its decodes' rows untouched). `seq_lens` counts cached + new tokens and
    `max_query_len` (at least the longest query) sizes the grid. Rows of no sequence are not written.
    """
    stride_kv, stride_slot, stride_cache_head = cache_strides(kv_cache)
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    check_heads(query, "query", head_dim)
    out = torch.empty_like(query) if out is None else out
    _check(query, kv_cache, block_tables, seq_lens, query_start_loc, out)
    num_seqs, num_heads = seq_lens.shape[0], query.shape[1]
    if num_seqs == 0 or max_query_len == 0:
        return out
    # Tiles of 16 in the interpreter (CPUs): the tests' short sequences then cross several.
    tile = 64 if query.is_cuda else 16
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, tile))
    cache, fp8 = cache_operand(kv_cache)
    _prefill_kernel[grid](
        query, cache, block_tables, seq_lens, query_start_loc, out, scale * LOG2_E, options.window or 0,
        query.stride(0), query.stride(1), stride_kv, stride_slot, stride_cache_head, block_tables.stride(0),
        out.stride(0), out.stride(1), GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=tile, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=tile,
        **dot_options(_prefill_kernel, query.dtype), FP8=fp8, SOFTCAP=softcap_constexpr(options.softcap),
        num_warps=num_warps(triton.next_power_of_2(head_dim)))
    return out


def _check(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           query_start_loc: torch.Tensor, out: torch.Tensor) -> None:
    num_seqs, num_kv_heads = seq_lens.shape[0], kv_cache.shape[3]
    if query.dtype != kv_cache.dtype and kv_cache.dtype not in FP8_FORMATS:
        raise ValueError(f"query is {query.dtype} but the cache holds {kv_cache.dtype}")
    if query.shape[1] % num_kv_heads:
        raise ValueError(f"{query.shape[1]} query heads do not group over {num_kv_heads} kv heads")
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match query {tuple(query.shape)} {query.dtype}")
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"{tuple(seq_lens.shape)} seq_lens need {num_seqs + 1} query starts, "
                         f"got {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] with contiguous rows, got "
                         f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
    if num_seqs > 1 and (seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1):
        raise ValueError("seq_lens and query_start_loc must be contiguous")
    if any(t.dtype.is_floating_point for t in (block_tables, seq_lens, query_start_loc)):
        raise ValueError("block_tables, seq_lens and query_start_loc must hold integers")
    check_device(_prefill_kernel, query, kv_cache, block_tables, seq_lens, query_start_loc, out)
