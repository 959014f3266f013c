"""Causal prefill attention for CPUs in bf16 and fp16 as chunked matmuls: what the torch backend runs
for prompts when the cache is not fp32.

SDPA's CPU flash kernel runs a 2,048-token prompt of the default model (9 query and 3 KV heads of 64)
in 80-90 ms per layer whatever the dtype, on the 2-core AVX512-BF16 EPYC with 1 thread: it does not
profit from the CPU's bf16 matmuls. Here each KV head's query group, `CHUNK` query rows at a time, is
one bf16 matmul against the keys up to the chunk's last position (the keys past it are never read:
causal), a softmax (computed in fp32 inside, returned in bf16), and one matmul with the values:
47-55 ms per layer in the same run. The scale is folded into the queries, and only the chunk's
diagonal block is masked.

Precision is that of bf16 scores (as `torch_decode`'s matmuls give): scores rounded to bf16, where
the flash kernel keeps them in fp32 until the probabilities; the oracle tests bound the effect.
"""

from __future__ import annotations

import torch

from kernels import reference

CHUNK = 256  # query rows per matmul: 128 and 512 ran slower at 2,048 tokens


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """query [heads, q, dim] at the last q positions of keys/values [kv_heads, s, dim] (q <= s): each
    query sees the keys up to its own position. Returns [heads, q, dim] in the keys' dtype."""
    heads, query_len, _ = query.shape
    kv_heads, seq_len, _ = keys.shape
    group = heads // kv_heads
    offset = seq_len - query_len  # position of query row 0
    scaled = (query.float() * scale).to(keys.dtype)
    out = torch.empty(query.shape, dtype=keys.dtype, device=query.device)
    future = torch.full((CHUNK, CHUNK), float("-inf"), dtype=keys.dtype, device=query.device).triu_(1)
    for kv_head in range(kv_heads):
        heads_of = slice(kv_head * group, (kv_head + 1) * group)
        for start in range(0, query_len, CHUNK):
            end = min(query_len, start + CHUNK)
            seen = offset + end  # keys [0, seen) are visible to some row of this chunk
            scores = torch.matmul(scaled[heads_of, start:end], keys[kv_head, :seen].T)  # [group, rows, seen]
            scores[:, :, offset + start:seen] += future[:end - start, :end - start]
            out[heads_of, start:end] = torch.matmul(torch.softmax(scores, dim=-1), values[kv_head, :seen])
    return out


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: list[int], seq_lens: list[int], scale: float,
                            key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `reference.paged_prefill_attention`."""
    out = torch.empty_like(query)
    for index, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[index], query_start_loc[index + 1]
        keys, values = reference.sequence_kv(kv_cache, block_tables[index], seq_len, start, end, key, value)
        attended = causal_attention(query[start:end].transpose(0, 1), keys[0], values[0], scale)
        out[start:end] = attended.transpose(0, 1).to(out.dtype)
    return out
