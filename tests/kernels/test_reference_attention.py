"""The paged torch reference against plain dense causal attention over the same keys and values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.model.attention.backend import AttentionMetadata
from cluster.model.attention.torch_backend import TorchAttentionBackend
from pdserve_kernels.reference import CAUSAL, AttentionOptions


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    options: AttentionOptions = CAUSAL) -> torch.Tensor:
    """query [q, H, D] at the last q positions of keys/values [s, Hkv, D]; causal, written out from
    transformers' definitions: a soft cap cap * tanh(score / cap) on the scaled scores, and a window
    that shows query position p the keys p - window < k <= p."""
    heads, kv_heads = query.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    values = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys.double()) * scale
    if options.softcap is not None:
        scores = options.softcap * torch.tanh(scores / options.softcap)
    q_len, s_len = query.shape[0], keys.shape[0]
    key_positions, query_positions = torch.arange(s_len)[None, :], torch.arange(s_len - q_len, s_len)[:, None]
    allowed = key_positions <= query_positions
    if options.window is not None:
        allowed &= key_positions > query_positions - options.window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double()).float()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 20)), min_size=1, max_size=5),
       st.sampled_from([(4, 4), (6, 2), (8, 1)]), st.sampled_from([4, 16]), st.integers(0, 2**16),
       st.sampled_from([CAUSAL, AttentionOptions(window=1), AttentionOptions(window=7),
                        AttentionOptions(window=9, softcap=1.5), AttentionOptions(softcap=0.7)]))
def test_paged_attention_matches_dense(sequences: list[tuple[int, int]], heads: tuple[int, int], block_size: int,
                                       seed: int, options: AttentionOptions) -> None:
    """Random (cached, new) token counts per sequence; decodes (new=1) first as the runner orders them;
    with and without a sliding window (as narrow as one token) and a soft cap on the scores."""
    sequences = sorted(sequences, key=lambda s: s[1] != 1)
    num_heads, num_kv_heads = heads
    head_dim = 8
    generator = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(cached + new) // block_size) for cached, new in sequences]
    num_blocks = sum(blocks_needed) + 3
    # Unwritten slots hold huge values: any that leaks past the mask wrecks the result.
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), 1e4)
    # Scatter each sequence's blocks over the pool in a random order.
    permutation = torch.randperm(num_blocks, generator=generator).tolist()
    tables, history, queries, new_keys, new_values, slots = [], [], [], [], [], []
    for (cached, new), count in zip(sequences, blocks_needed, strict=True):
        table, permutation = permutation[:count], permutation[count:]
        tables.append(table)
        keys = torch.randn(cached + new, num_kv_heads, head_dim, generator=generator)
        values = torch.randn(cached + new, num_kv_heads, head_dim, generator=generator)
        for position in range(cached):
            slot = table[position // block_size] * block_size + position % block_size
            kv_cache[0].view(-1, num_kv_heads, head_dim)[slot] = keys[position]
            kv_cache[1].view(-1, num_kv_heads, head_dim)[slot] = values[position]
        history.append((keys, values))
        queries.append(torch.randn(new, num_heads, head_dim, generator=generator) * 3)
        new_keys.append(keys[cached:])
        new_values.append(values[cached:])
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
    max_blocks = max(blocks_needed)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
    seq_lens = [cached + new for cached, new in sequences]
    starts = [0]
    for _, new in sequences:
        starts.append(starts[-1] + new)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=block_tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), num_decodes=sum(1 for _, n in sequences if n == 1),
        max_seq_len=max(seq_lens), seq_lens_list=seq_lens, query_start_list=starts)
    scale = head_dim ** -0.5
    out = TorchAttentionBackend().forward(torch.cat(queries), torch.cat(new_keys), torch.cat(new_values), kv_cache,
                                          metadata, scale, options)
    expected = torch.cat([dense_attention(q, k, v, scale, options)
                          for q, (k, v) in zip(queries, history, strict=True)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [CAUSAL, AttentionOptions(window=20), AttentionOptions(window=3, softcap=2.0)],
                         ids=["causal", "window", "window-softcap"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_matmul_decode_matches_the_reference(dtype: torch.dtype, tolerance: float,
                                                     options: AttentionOptions) -> None:
    """`pdserve_kernels.torch_decode` (the torch backend's decode attention in bf16) against the SDPA reference:
    blocks scattered over the pool, unwritten slots huge (a leak past a sequence's end shows), GQA
    groups of 3, and a padding row of length 0 that must come out zeros."""
    from pdserve_kernels import reference, torch_decode

    generator = torch.Generator().manual_seed(3)
    kv_cache = torch.full((2, 20, 16, 3, 64), 1e4).to(dtype)
    block_tables = torch.randperm(20, generator=generator)[:12].view(3, 4)
    seq_lens = torch.tensor([50, 64, 0], dtype=torch.int32)
    for row, length in enumerate(seq_lens.tolist()):
        for position in range(length):
            block, offset = block_tables[row, position // 16], position % 16
            kv_cache[:, block, offset] = torch.randn(2, 3, 64, generator=generator).to(dtype)
    query = torch.randn(3, 9, 64, generator=generator).to(dtype)
    expected = reference.paged_decode_attention(query, kv_cache, block_tables, seq_lens, 64, 0.125, options)
    got = torch_decode.paged_decode_attention(query, kv_cache, block_tables, seq_lens, 64, 0.125, options)
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
