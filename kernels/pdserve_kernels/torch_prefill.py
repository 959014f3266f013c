"""Causal prefill attention for CPUs in bf16 and fp16 as chunked matmuls: what the torch backend runs
for prompts when the cache is not fp32.

SDPA's CPU flash kernel takes about as long for a prompt in bf16 as in fp32 on a CPU without AMX: it
does not profit from the CPU's bf16 matmuls. Here each KV head's query group, `CHUNK` query positions at a
time, is one bf16 matmul against the keys up to the chunk's last position (the keys past it are never
read: causal), a softmax, and one matmul with the values. The queries are laid out [kv_head,
position, head of the group, dim], so a chunk's rows of all the group's heads are one contiguous
matrix (no copy before the matmuls) and its output rows land in place. The scale is folded into the
queries. In bf16 on a CPU where `kernels/pdserve_kernels/cpu_fused.c` builds, the mask and the softmax are one C pass
(`causal_softmax_`: no exp of a masked score); elsewhere the diagonal block is masked and torch's
softmax runs. docs/performance.md has the figures.

Where the CPU has AMX, torch's flash kernel multiplies in AMX tiles and is faster than these
matmuls, per layer and for a whole prompt in the engine. `sdpa_is_faster` is that choice.

Precision is that of bf16 scores (as `torch_decode`'s matmuls give): scores rounded to bf16, where
the flash kernel keeps them in fp32 until the probabilities; the oracle tests bound the effect.
"""

from __future__ import annotations

import functools

import torch

from pdserve_kernels import cpu_fused, reference

CHUNK = 256  # query positions per matmul: faster than 128 or 512 on 2,048-token prompts
use_c_softmax = True  # False: torch's mask and softmax (the benchmarks compare both in one run)


@functools.cache
def sdpa_is_faster() -> bool:
    """Whether SDPA's flash kernel beats these chunks for bf16 prompts on this CPU: where it has AMX."""
    return bool(torch.cpu.get_capabilities().get("amx_bf16"))


def grouped_causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                             options: reference.AttentionOptions = reference.CAUSAL) -> torch.Tensor:
    """query [q, heads, dim] (tokens first, as the model holds it) at the last q positions of
    keys/values [kv_heads, s, dim] (q <= s). Returns [kv_heads, q, group, dim] in the keys' dtype:
    query head h = kv_head * group + g. Under a sliding window a chunk reads only the keys some row of
    it sees; a window or a soft cap takes torch's mask and softmax (`windowed_probs`)."""
    query_len, heads, dim = query.shape
    kv_heads, seq_len, _ = keys.shape
    group = heads // kv_heads
    offset = seq_len - query_len  # position of query row 0
    grouped = query.reshape(query_len, kv_heads, group, dim).transpose(0, 1)
    scaled = torch.empty((kv_heads, query_len, group, dim), dtype=keys.dtype, device=query.device)
    if query.dtype == keys.dtype:
        torch.mul(grouped, scale, out=scaled)  # fp32 inside, one rounding: as (q.float() * scale).to(dtype)
    else:
        scaled.copy_(grouped.float() * scale)
    out = torch.empty_like(scaled)
    c_softmax = use_c_softmax and keys.dtype == torch.bfloat16 and keys.device.type == "cpu" \
        and cpu_fused.available(torch.bfloat16)
    future = None if c_softmax else torch.full((CHUNK, CHUNK), float("-inf"), dtype=keys.dtype,
                                               device=query.device).triu_(1)
    # Every chunk's scores in one buffer: a fresh [rows * group, seen] tensor per chunk is a large
    # allocation, mapped and faulted in anew each time, which costs several percent of the layer.
    scratch = torch.empty(min(CHUNK, query_len) * group * seq_len, dtype=keys.dtype, device=query.device)
    plain = options == reference.CAUSAL
    for kv_head in range(kv_heads):
        for start in range(0, query_len, CHUNK):
            end = min(query_len, start + CHUNK)
            seen = offset + end  # keys [0, seen) are visible to some row of this chunk
            first = 0 if options.window is None else max(0, offset + start - options.window + 1)
            scores = scratch[:(end - start) * group * (seen - first)].view((end - start) * group, seen - first)
            torch.mm(scaled[kv_head, start:end].view(-1, dim), keys[kv_head, first:seen].T, out=scores)
            if not plain:
                probs = windowed_probs(scores, offset + start, first, group, options)
            elif c_softmax:
                probs = cpu_fused.causal_softmax_(scores, offset + start + 1, repeat=group)
            else:
                assert future is not None
                rows = end - start
                scores.view(rows, group, seen)[:, :, offset + start:] += future[:rows, None, :rows]
                probs = torch.softmax(scores, dim=-1)
            torch.mm(probs, values[kv_head, first:seen], out=out[kv_head, start:end].view(-1, dim))
    return out


def windowed_probs(scores: torch.Tensor, position: int, first_key: int, group: int,
                   options: reference.AttentionOptions) -> torch.Tensor:
    """A chunk's probabilities under a window or soft cap: scores [rows * group, keys] of query rows at
    positions position, position + 1, ... against the keys from `first_key` on; soft-capped, masked and
    normalized in fp32 (a cap's tanh in bf16 would add bf16's error twice), returned in the scores' dtype."""
    rows, cols = scores.shape[0] // group, scores.shape[1]
    capped = reference.soft_cap(scores.float(), options.softcap)
    positions = torch.arange(position, position + rows, device=scores.device)
    hidden = ~reference.visible_keys(positions, cols, options.window, first_key)
    capped.view(rows, group, cols).masked_fill_(hidden[:, None, :], float("-inf"))
    return capped.softmax(-1).to(scores.dtype)


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                     options: reference.AttentionOptions = reference.CAUSAL) -> torch.Tensor:
    """query [heads, q, dim] at the last q positions of keys/values [kv_heads, s, dim] (q <= s): each
    query sees the keys up to its own position (inside the window, if any). Returns [heads, q, dim] in
    the keys' dtype."""
    heads, query_len, dim = query.shape
    out = grouped_causal_attention(query.transpose(0, 1), keys, values, scale, options)
    return out.permute(0, 2, 1, 3).reshape(heads, query_len, dim)


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,  # noqa: PLR0913
                            query_start_loc: list[int], seq_lens: list[int], scale: float,
                            key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                            options: reference.AttentionOptions = reference.CAUSAL) -> torch.Tensor:
    """Same contract as `reference.paged_prefill_attention`."""
    out = torch.empty_like(query)
    heads, dim = query.shape[1:]
    for index, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[index], query_start_loc[index + 1]
        keys, values = reference.sequence_kv(kv_cache, block_tables[index], seq_len, start, end, key, value,
                                             reference.attention_dtype(kv_cache, query))
        attended = grouped_causal_attention(query[start:end], keys[0], values[0], scale, options)  # [kv, q, group, dim]
        kv_heads = attended.shape[0]
        out[start:end].view(end - start, kv_heads, heads // kv_heads, dim).copy_(attended.transpose(0, 1))
    return out
