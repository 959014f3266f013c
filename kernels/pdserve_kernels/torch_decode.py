"""Paged decode attention for CPUs in torch ops: what the torch backend runs for decode rows.

`reference.paged_decode_attention` (the tests' oracle) calls `scaled_dot_product_attention` with a
padding mask and GQA; on CPUs that takes the math path. One query token per sequence needs no more
than two grouped matmuls: each KV head's query group times its keys, a softmax in fp32, times its
values: a fraction of SDPA's time in fp32 and in bf16, gather included (docs/performance.md). The
gathered keys and values are made contiguous first: matmuls over the gather's transposed view are
slower than SDPA.
"""

from __future__ import annotations

import torch

from pdserve_kernels import reference


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,  # noqa: PLR0913
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           options: reference.AttentionOptions = reference.CAUSAL) -> torch.Tensor:
    """One query token per sequence ([batch, heads, head_dim]) over its cached context (its window's
    last tokens where `options` slides one); a sequence of length 0 (a padding row) gives zeros."""
    # [batch, kv_heads, max_seq_len, head_dim]; an fp8 cache widened to the query's dtype
    keys, values = reference.gather_kv(kv_cache, block_tables, max_seq_len, reference.attention_dtype(kv_cache, query))
    keys, values = keys.contiguous(), values.contiguous()
    batch, heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    # The query heads that share a KV head side by side, so each KV head is read once: [batch, kv_heads, group, dim].
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim).to(keys.dtype)
    scores = reference.soft_cap(torch.matmul(grouped, keys.transpose(-1, -2)).float().mul_(scale), options.softcap)
    hidden = ~reference.visible_keys(seq_lens - 1, max_seq_len, options.window)
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    # A row with nothing to attend to is all -inf: its softmax is NaN, made 0 (as the Triton kernel gives).
    probs = scores.softmax(-1).nan_to_num_(0.0).to(values.dtype)
    return torch.matmul(probs, values).reshape(batch, heads, head_dim).to(query.dtype)
