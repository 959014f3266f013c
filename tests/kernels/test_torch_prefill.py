"""The chunked prefill attention (`kernels/pdserve_kernels/torch_prefill.py`, the torch backend's prefill in bf16)
against the SDPA reference: prompts longer than a chunk, cached prefixes (chunked prefill), GQA, and
the paged form with blocks out of order and the step's own keys."""

from __future__ import annotations

import pytest
import torch

from pdserve_kernels import reference, torch_prefill
from pdserve_kernels.reference import AttentionOptions

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.fixture(params=[True, False], ids=["c-softmax", "torch-softmax"], autouse=True)
def softmax_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both paths of the chunks' mask and softmax: the C pass (bf16 where it builds) and torch's."""
    monkeypatch.setattr(torch_prefill, "use_c_softmax", request.param)
    return bool(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("query_len", "seq_len"), [(300, 300), (1, 1), (256, 256), (130, 530), (5, 257)])
def test_causal_attention_matches_sdpa(dtype: torch.dtype, query_len: int, seq_len: int) -> None:
    generator = torch.Generator().manual_seed(query_len + seq_len)
    query = torch.randn(6, query_len, 32, generator=generator).to(dtype)
    keys = torch.randn(2, seq_len, 32, generator=generator).to(dtype)
    values = torch.randn(2, seq_len, 32, generator=generator).to(dtype)
    rows = torch.arange(seq_len - query_len, seq_len)[:, None]
    mask = torch.arange(seq_len)[None, :] <= rows
    expected = torch.nn.functional.scaled_dot_product_attention(
        query[None].float(), keys[None].float(), values[None].float(), attn_mask=mask, scale=0.2, enable_gqa=True)[0]
    got = torch_prefill.causal_attention(query, keys, values, 0.2)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("options", [AttentionOptions(window=8), AttentionOptions(window=200),
                                     AttentionOptions(window=40, softcap=2.5), AttentionOptions(softcap=1.0)],
                         ids=["window-8", "window-200", "window-softcap", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("query_len", "seq_len"), [(300, 300), (130, 530), (5, 257)])
def test_windowed_and_capped_chunks_match_the_reference(dtype: torch.dtype, query_len: int, seq_len: int,
                                                        options: AttentionOptions) -> None:
    """A sliding window (of 8 tokens, and of 200, near a chunk's 256: a chunk past the first skips the keys
    before its window) and a soft cap, with and without a cached prefix, against the reference's mask."""
    generator = torch.Generator().manual_seed(query_len + seq_len)
    query = torch.randn(6, query_len, 32, generator=generator).to(dtype)
    keys, values = (torch.randn(2, seq_len, 32, generator=generator).to(dtype) for _ in range(2))
    mask = reference.visible_keys(torch.arange(seq_len - query_len, seq_len), seq_len, options.window)
    expected = reference.attend(query[None].float(), keys[None].float(), values[None].float(), mask, 0.2,
                                options.softcap)[0]
    got = torch_prefill.causal_attention(query, keys, values, 0.2, options)
    torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    whole = torch_prefill.causal_attention(query, keys, values, 0.2)
    assert not torch.allclose(got.float(), whole.float(), atol=0.1), "the options must change the answer"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_matches_the_reference(dtype: torch.dtype) -> None:
    """Three prompts in one step, one with a cached prefix, blocks scattered out of order; the new
    tokens' keys are in the cache and passed along (as the backend does)."""
    generator = torch.Generator().manual_seed(5)
    block_size, kv_heads, heads, dim = 16, 3, 9, 64
    seq_lens, query_lens = [270, 40, 33], [270, 7, 33]
    kv_cache = torch.full((2, 64, block_size, kv_heads, dim), 1e4).to(dtype)
    block_tables = torch.randperm(64, generator=generator)[:3 * 20].view(3, 20)
    starts, slots = [0], []
    for row, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for position in range(seq_len):
            block, offset = block_tables[row, position // block_size], position % block_size
            kv_cache[:, block, offset] = torch.randn(2, kv_heads, dim, generator=generator).to(dtype)
        slots += [int(block_tables[row, p // block_size]) * block_size + p % block_size
                  for p in range(seq_len - query_len, seq_len)]
        starts.append(starts[-1] + query_len)
    flat = kv_cache.view(2, -1, kv_heads, dim)
    key, value = flat[0, slots], flat[1, slots]
    query = torch.randn(starts[-1], heads, dim, generator=generator).to(dtype)
    expected = reference.paged_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.125)
    got = torch_prefill.paged_prefill_attention(query, kv_cache, block_tables, starts, seq_lens, 0.125, key, value)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_bf16_prompts_take_sdpa_where_the_cpu_has_amx_and_the_chunks_elsewhere(
        amx: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend's bf16 prefill: SDPA's flash kernel where torch finds AMX (it multiplies in AMX
    tiles there and beats the chunks), the chunked matmuls elsewhere; fp32 prompts take SDPA on any CPU.
    Both give the reference's answer."""
    from cluster.model.attention.backend import AttentionMetadata
    from cluster.model.attention.torch_backend import TorchAttentionBackend

    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": amx, "avx512_bf16": True})
    torch_prefill.sdpa_is_faster.cache_clear()
    monkeypatch.setattr(TorchAttentionBackend, "use_chunked_prefill", None)
    taken: list[str] = []
    for name, module in (("chunks", torch_prefill), ("sdpa", reference)):
        def spy(*args: object, _name: str = name, _real: object = module.paged_prefill_attention,
                **kwargs: object) -> torch.Tensor:
            taken.append(_name)
            return _real(*args, **kwargs)  # type: ignore[operator]
        monkeypatch.setattr(module, "paged_prefill_attention", spy)
    generator = torch.Generator().manual_seed(3)
    seq_len, kv_heads, heads, dim = 40, 3, 9, 64
    try:
        for dtype in (torch.bfloat16, torch.float32):
            kv_cache = torch.zeros(2, 4, 16, kv_heads, dim, dtype=dtype)
            query = torch.randn(seq_len, heads, dim, generator=generator).to(dtype)
            key, value = (torch.randn(seq_len, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
            metadata = AttentionMetadata(
                slot_mapping=torch.arange(seq_len), block_tables=torch.arange(4)[None],
                seq_lens=torch.tensor([seq_len], dtype=torch.int32),
                query_start_loc=torch.tensor([0, seq_len], dtype=torch.int32), num_decodes=0, max_seq_len=seq_len,
                seq_lens_list=[seq_len], query_start_list=[0, seq_len])
            got = TorchAttentionBackend().forward(query, key, value, kv_cache, metadata, 0.125)
            expected = torch.nn.functional.scaled_dot_product_attention(
                query.transpose(0, 1)[None].float(), key.transpose(0, 1)[None].float(),
                value.transpose(0, 1)[None].float(), is_causal=True, scale=0.125, enable_gqa=True)[0].transpose(0, 1)
            torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    finally:
        torch_prefill.sdpa_is_faster.cache_clear()
    assert taken == (["sdpa", "sdpa"] if amx else ["chunks", "sdpa"])
