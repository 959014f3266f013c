"""Torch reference implementations of the paged KV cache ops: the CPU backend and the test oracle.

Layout of one layer's cache (the same for every backend):

    kv_cache[0 = key | 1 = value, block_id, offset_in_block, kv_head, head_dim]

A token at position p of a sequence lives in block `block_table[p // block_size]`, at offset
`p % block_size`; its flat slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = {torch.float8_e5m2: 57344.0, torch.float8_e4m3fn: 448.0}  # the largest finite values


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to a cache's dtype; to fp8 saturated at its largest finite value first (torch's cast
    overflows to inf, and one inf key makes a softmax NaN)."""
    if dtype in FP8_MAX:
        return x.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return x.to(dtype)


def attention_dtype(kv_cache: torch.Tensor, query: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in: the cache's, or the query's over an fp8 cache (widened as read)."""
    return query.dtype if kv_cache.dtype.itemsize == 1 else kv_cache.dtype


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter new keys and values ([tokens, kv_heads, head_dim]) into their slots."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    for half, x in zip(flat, (key, value), strict=True):
        cast = to_cache_dtype(x, kv_cache.dtype)
        if kv_cache.dtype.itemsize == 1:  # index_copy_ takes no fp8 on CPUs: copy the bytes
            half, cast = half.view(torch.uint8), cast.view(torch.uint8)
        half.index_copy_(0, slot_mapping, cast)


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each sequence laid out contiguously: [batch, kv_heads, max_seq_len, head_dim],
    in `dtype` where given (an fp8 cache widened to the dtype attention computes in), else the cache's.

    Whole blocks are copied as rows with `index_select`: several times faster on CPUs than advanced
    indexing of the 5-D cache, which copies element-wise.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    blocks_per_seq = -(-max_seq_len // block_size)
    table = block_tables[:, :blocks_per_seq].reshape(-1)
    batch = block_tables.shape[0]
    shape = (batch, blocks_per_seq * block_size, num_kv_heads, head_dim)
    rows = kv_cache.view(2, num_blocks, -1)
    keys, values = (rows[half].index_select(0, table).view(shape)[:, :max_seq_len].to(dtype or kv_cache.dtype)
                    for half in (0, 1))
    return keys.transpose(1, 2), values.transpose(1, 2)


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
    """One query token per sequence ([batch, heads, head_dim]) over its whole cached context."""
    keys, values = gather_kv(kv_cache, block_tables, max_seq_len, attention_dtype(kv_cache, query))
    positions = torch.arange(max_seq_len, device=query.device)
    mask = (positions[None, :] < seq_lens[:, None].to(positions.dtype))[:, None, None, :]
    out = F.scaled_dot_product_attention(query.unsqueeze(2).to(keys.dtype), keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2).to(query.dtype)


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: list[int], seq_lens: list[int], scale: float,
                            key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
    """Variable-length causal attention ([tokens, heads, head_dim]): each sequence's new tokens
    attend to its cached prefix and to themselves. Sequences are handled one at a time.

    `key` and `value` ([tokens, kv_heads, head_dim]), the step's new keys and values as written to
    the cache, spare the gather for a sequence with no cached prefix: all it attends to is in them."""
    out = torch.empty_like(query)
    for index, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[index], query_start_loc[index + 1]
        query_len = end - start
        keys, values = sequence_kv(kv_cache, block_tables[index], seq_len, start, end, key, value,
                                   attention_dtype(kv_cache, query))
        q = query[start:end].transpose(0, 1).unsqueeze(0).to(keys.dtype)
        if query_len == seq_len:
            attended = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query i sits at position seq_len - query_len + i and sees every key up to it.
            rows = torch.arange(seq_len - query_len, seq_len, device=query.device)[:, None]
            mask = torch.arange(seq_len, device=query.device)[None, :] <= rows
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = attended[0].transpose(0, 1).to(out.dtype)
    return out


def sequence_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, start: int, end: int,
                key: torch.Tensor | None, value: torch.Tensor | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefilling sequence's keys and values, [1, kv_heads, seq_len, head_dim] in `dtype` (see
    `attention_dtype`): its new tokens' own (rows start:end of `key`/`value`) where it has no cached
    prefix, else gathered. Over an fp8 cache its own are rounded to fp8 too: every attention sees the
    keys and values as the cache holds them, whichever way a prompt is cut."""
    if end - start == seq_len and key is not None and value is not None:
        keys, values = (to_cache_dtype(x[start:end], kv_cache.dtype).to(dtype).transpose(0, 1).unsqueeze(0)
                        for x in (key, value))
        return keys, values
    return gather_kv(kv_cache, block_table.unsqueeze(0), seq_len, dtype)


# The elementwise ops between the model's matmuls, as torch ops: the model's path where the fused CPU
# kernels (`kernels/pdserve_kernels/cpu_fused.c`) are not used, and their oracle.

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, normalized in fp32, rounded to x's dtype, then scaled."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); without a residual, (rms_norm(x), x)."""
    summed = x if residual is None else x + residual
    return rms_norm(summed, weight, eps), summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated per token (Hugging Face's non-interleaved halves) by cos and
    sin [tokens, 1, head_dim / 2] float32: computed in fp32, returned in x's dtype."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


def causal_softmax(scores: torch.Tensor, visible: int, repeat: int = 1) -> torch.Tensor:
    """scores [rows, cols]: row i the softmax of its first `visible + i // repeat` entries, the rest 0."""
    rows, cols = scores.shape
    seen = torch.arange(cols)[None, :] < (visible + torch.arange(rows) // repeat)[:, None]
    return torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
