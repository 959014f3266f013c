"""Torch reference implementations of the paged KV cache ops: the CPU backend and the test oracle.

Layout of one layer's cache (the same for every backend):

    kv_cache[0 = key | 1 = value, block_id, offset_in_block, kv_head, head_dim]

A token at position p of a sequence lives in block `block_table[p // block_size]`, at offset
`p % block_size`; its flat slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_MAX = {torch.float8_e5m2: 57344.0, torch.float8_e4m3fn: 448.0}  # the largest finite values


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """What a layer's attention adds to plain causal attention over its context; every kernel takes it.

    `window`: a sliding window, as transformers' sliding mask draws it: a query at position p sees the
    keys at p - window < k <= p (itself and the window - 1 before it). None: the whole context.
    `softcap`: scores (after the scale) become softcap * tanh(score / softcap) before the mask and
    softmax (Gemma 2's `attn_logit_softcapping`). None: left as they are."""

    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window covers at least one token, got {self.window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"a soft cap must be positive, got {self.softcap}")


CAUSAL = AttentionOptions()


def visible_keys(query_positions: torch.Tensor, num_keys: int, window: int | None,
                 first_key: int = 0) -> torch.Tensor:
    """[queries, num_keys] bool: whether the key at position first_key + j is visible to the query at
    query_positions[i] (causal, and inside the window where there is one)."""
    keys = torch.arange(first_key, first_key + num_keys, device=query_positions.device)[None, :]
    positions = query_positions.to(keys.dtype)[:, None]
    mask = keys <= positions
    return mask if window is None else mask & (keys > positions - window)


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """softcap * tanh(scores / softcap) (a new tensor), or scores as they are without a cap."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


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


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,  # noqa: PLR0913
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           options: AttentionOptions = CAUSAL) -> torch.Tensor:
    """One query token per sequence ([batch, heads, head_dim]), at its last position, over its cached
    context (the window's last tokens of it where `options` slides one)."""
    keys, values = gather_kv(kv_cache, block_tables, max_seq_len, attention_dtype(kv_cache, query))
    mask = visible_keys(seq_lens - 1, max_seq_len, options.window)[:, None, None, :]
    out = attend(query.unsqueeze(2).to(keys.dtype), keys, values, mask, scale, options.softcap)
    return out.squeeze(2).to(query.dtype)


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None, is_causal: bool = False) -> torch.Tensor:
    """SDPA (query [batch, heads, q, dim], keys/values [batch, kv_heads, s, dim], GQA) under a boolean
    mask, or `is_causal`; with a soft cap, which SDPA has no place for, the same in fp32 torch ops. A
    row that sees nothing comes out zeros."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = query.shape[1] // keys.shape[1]
    keys, values = (x.float().repeat_interleave(group, dim=1) for x in (keys, values))
    scores = soft_cap(torch.matmul(query.float(), keys.transpose(-1, -2)) * scale, softcap)
    if is_causal:
        mask = visible_keys(torch.arange(query.shape[2], device=query.device), keys.shape[2], None)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)
    return torch.matmul(probs, values).to(query.dtype)


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,  # noqa: PLR0913
                            query_start_loc: list[int], seq_lens: list[int], scale: float,
                            key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                            options: AttentionOptions = CAUSAL) -> torch.Tensor:
    """Variable-length causal attention ([tokens, heads, head_dim]): each sequence's new tokens
    attend to its cached prefix and to themselves (inside `options`' window, if any). Sequences are
    handled one at a time.

    `key` and `value` ([tokens, kv_heads, head_dim]), the step's new keys and values as written to
    the cache, spare the gather for a sequence with no cached prefix: all it attends to is in them."""
    out = torch.empty_like(query)
    for index, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[index], query_start_loc[index + 1]
        query_len = end - start
        keys, values = sequence_kv(kv_cache, block_tables[index], seq_len, start, end, key, value,
                                   attention_dtype(kv_cache, query))
        q = query[start:end].transpose(0, 1).unsqueeze(0).to(keys.dtype)
        if query_len == seq_len and options.window is None:
            attended = attend(q, keys, values, None, scale, options.softcap, is_causal=True)
        else:
            # Query i sits at position seq_len - query_len + i.
            rows = torch.arange(seq_len - query_len, seq_len, device=query.device)
            attended = attend(q, keys, values, visible_keys(rows, seq_len, options.window), scale, options.softcap)
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


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up with gelu's tanh approximation (GeGLU, Gemma's `gelu_pytorch_tanh`), gate and
    up the two halves of the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


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
