"""The C decode kernel (`kernels/pdserve_kernels/cpu_decode.c`) against the torch reference, on the paged cache as the
runner lays it out: blocks scattered over the pool out of order, ragged lengths ending mid-block,
padding rows of length 0, GQA groups, and every head size the kernel treats apart (64, 128, other),
through both of its loops (16 tokens at a time and one at a time) and for CPUs with and without
AVX-512; caches in the model's dtype and in fp8 e5m2 (`kv_cache_dtype`) under bf16 and fp32 queries."""

from __future__ import annotations

import platform

import pytest
import torch

from pdserve_kernels import cpu_build, cpu_decode, reference
from pdserve_kernels.reference import AttentionOptions

pytestmark = pytest.mark.skipif(not cpu_decode.available(torch.float32), reason="no C compiler on this machine")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
FP8, E4M3 = torch.float8_e5m2, torch.float8_e4m3fn
# (query dtype, cache dtype): the model's dtype for both, or an fp8 cache under it.
DTYPES = [pytest.param((torch.float32, torch.float32), id="fp32"),
          pytest.param((torch.bfloat16, torch.bfloat16), id="bf16"),
          pytest.param((torch.float32, FP8), id="fp32-e5m2cache"),
          pytest.param((torch.bfloat16, FP8), id="bf16-e5m2cache"),
          pytest.param((torch.float32, E4M3), id="fp32-e4m3cache"),
          pytest.param((torch.bfloat16, E4M3), id="bf16-e4m3cache")]
BLOCK_SIZE = 16
X86 = platform.machine() in ("x86_64", "AMD64")
AVX512 = "avx512f" in cpu_build.cpu_flags().split()
# This CPU's build (AVX512-BF16 dot products where it has them), an AVX2-only CPU's (plain C) and,
# where AVX-512 runs, an AVX-512 CPU's without bf16 dot products.
MARCHES = ["native", pytest.param("x86-64-v3", marks=pytest.mark.skipif(not X86, reason="x86 only")),
           pytest.param("skylake-avx512", marks=pytest.mark.skipif(not AVX512, reason="no AVX-512 here"))]


def paged_case(seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int,
               block_size: int = BLOCK_SIZE, query_dtype: torch.dtype | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, kv_cache, block_tables, seq_lens): each sequence's tokens written into randomly chosen
    blocks of a cache of `dtype`; every slot left unwritten holds 1e4, so a read past a sequence's end
    shows. The query in `query_dtype` (default: the cache's)."""
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-length // block_size) for length in seq_lens) + 1  # one spare column of padding
    num_blocks = len(seq_lens) * max_blocks + 3
    kv_cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), 1e4)
    block_tables = torch.randperm(num_blocks, generator=generator)[:len(seq_lens) * max_blocks]
    block_tables = block_tables.view(len(seq_lens), max_blocks)
    for row, length in enumerate(seq_lens):
        for position in range(length):
            block, offset = block_tables[row, position // block_size], position % block_size
            kv_cache[:, block, offset] = torch.randn(2, kv_heads, head_dim, generator=generator)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=generator).to(query_dtype or dtype)
    return query, kv_cache.to(dtype), block_tables, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 40), (8, 1, 64)])
def test_decode_kernel_matches_the_reference(march: str, dtypes: tuple[torch.dtype, torch.dtype], heads: int,
                                             kv_heads: int, head_dim: int, tiled: bool) -> None:
    query_dtype, dtype = dtypes
    seq_lens = [50, 1, 16, 0, 142, 33, 17]  # mid-block, one token, one exact block, padding, longer, ...
    query, kv_cache, block_tables, lens = paged_case(seq_lens, heads, kv_heads, head_dim, dtype, seed=head_dim,
                                                     query_dtype=query_dtype)
    scale = head_dim ** -0.5
    expected = reference.paged_decode_attention(query, kv_cache, block_tables, lens, max(seq_lens), scale)
    got = cpu_decode.paged_decode_attention(query, kv_cache, block_tables, lens, max(seq_lens), scale, march=march,
                                            tiled=tiled)
    assert got.dtype == query_dtype and got.shape == query.shape
    tolerance = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got[3], torch.zeros_like(got[3])), "a padding row (length 0) must come out zeros"


@pytest.fixture(params=[True, False], ids=["tiled", "token-at-a-time"])
def tiled(request: pytest.FixtureRequest) -> bool:
    """Both loops of the kernel where the build has AVX-512: 16 tokens at a time (the default) and one."""
    return bool(request.param)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(12, 2, 64, 16), (6, 2, 128, 16), (9, 3, 64, 8), (9, 3, 64, 32), (5, 5, 64, 4)])
def test_tiles_over_query_groups_and_block_sizes(march: str, dtypes: tuple[torch.dtype, torch.dtype], heads: int,
                                                 kv_heads: int, head_dim: int, block_size: int, tiled: bool) -> None:
    """The tiled loops' seams: query groups split over register-sized chunks (6 heads of 64: 4 + 2; 3 of
    128: 2 + 1), 16-token tiles that span several blocks (block size 4, 8) or sit inside one (32), and
    tiles cut short at a sequence's end (lengths around 16 and 32)."""
    query_dtype, dtype = dtypes
    seq_lens = [15, 16, 17, 0, 31, 32, 33, 77, 1]
    query, kv_cache, block_tables, lens = paged_case(seq_lens, heads, kv_heads, head_dim, dtype, seed=block_size,
                                                     block_size=block_size, query_dtype=query_dtype)
    scale = head_dim ** -0.5
    expected = reference.paged_decode_attention(query, kv_cache, block_tables, lens, max(seq_lens), scale)
    got = cpu_decode.paged_decode_attention(query, kv_cache, block_tables, lens, max(seq_lens), scale, march=march,
                                            tiled=tiled)
    tolerance = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got[3], torch.zeros_like(got[3])), "a padding row (length 0) must come out zeros"


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("fp8", [FP8, E4M3], ids=["e5m2", "e4m3"])
def test_every_fp8_value_is_read_exactly(march: str, fp8: torch.dtype, tiled: bool) -> None:
    """With one token of context a head's output is that token's value: each of the 256 bytes
    (subnormals, zeros, the largest, e5m2's infinities; NaNs aside) must come out as torch widens it."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(fp8).float().isnan()]
    codes = torch.cat([codes, codes[:256 - len(codes)]])  # 256 again: 4 rows of 64
    kv_cache = torch.zeros(2, 4, BLOCK_SIZE, 1, 64, dtype=torch.uint8)
    kv_cache[1, :, 0, 0] = codes.view(4, 64)  # each sequence's one value row; keys 0
    kv_cache = kv_cache.view(fp8)
    query = torch.randn(4, 2, 64)
    lens = torch.ones(4, dtype=torch.int32)
    got = cpu_decode.paged_decode_attention(query, kv_cache, torch.arange(4).view(4, 1), lens, 1, 0.125, march=march,
                                            tiled=tiled)
    expected = codes.view(fp8).float().view(4, 1, 64).expand(4, 2, 64)
    assert torch.equal(got, expected)


def test_decode_kernel_threads_agree() -> None:
    """Rows are spread over torch's intra-op threads: two threads give what one gives, bit for bit."""
    query, kv_cache, block_tables, lens = paged_case([70, 3, 129, 64, 5], 9, 3, 64, torch.bfloat16, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.paged_decode_attention(query, kv_cache, block_tables, lens, 129, 0.125)
        torch.set_num_threads(2)
        two = cpu_decode.paged_decode_attention(query, kv_cache, block_tables, lens, 129, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_decode_kernel_refuses_what_it_cannot_read() -> None:
    query, kv_cache, block_tables, lens = paged_case([20, 5], 9, 3, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="longer than its block table"):
        cpu_decode.paged_decode_attention(query, kv_cache, block_tables[:, :1], lens, 20, 0.125)
    with pytest.raises(ValueError, match="int64"):
        cpu_decode.paged_decode_attention(query, kv_cache, block_tables.int(), lens, 20, 0.125)
    with pytest.raises(ValueError, match="KV heads"):
        cpu_decode.paged_decode_attention(query[:, :8], kv_cache, block_tables, lens, 20, 0.125)


def test_query_rows_may_be_strided() -> None:
    """The model hands over a view into the step's rotated q + k rows: read in place, same result."""
    query, kv_cache, block_tables, lens = paged_case([40, 0, 17], 9, 3, 64, torch.bfloat16, seed=3)
    rows = torch.cat([query, torch.randn(3, 3, 64).bfloat16()], dim=1)  # q heads then k heads, per row
    view = rows[:, :9]
    assert not view.is_contiguous()
    got = cpu_decode.paged_decode_attention(view, kv_cache, block_tables, lens, 40, 0.125)
    assert torch.equal(got, cpu_decode.paged_decode_attention(query, kv_cache, block_tables, lens, 40, 0.125))


def test_the_kernel_refuses_a_length_past_its_table_or_negative() -> None:
    """The kernel checks every length against its table before reading anything, in every build (the
    wrapper does not: that would cost a sync to Python per layer)."""
    query, kv_cache, block_tables, lens = paged_case([20, 5], 9, 3, 64, torch.float32, seed=2)
    for march in ("native", "x86-64-v3") if X86 else ("native",):
        for bad in (block_tables.shape[1] * BLOCK_SIZE + 1, -1):
            lens[1] = bad
            with pytest.raises(ValueError, match="longer than its block table"):
                cpu_decode.paged_decode_attention(query, kv_cache, block_tables, lens, 20, 0.125, march=march)
        lens[1] = block_tables.shape[1] * BLOCK_SIZE  # the whole table: allowed
        cpu_decode.paged_decode_attention(query, kv_cache, block_tables, lens, 20, 0.125, march=march)


WINDOWED = [pytest.param(AttentionOptions(window=5), id="window-5"),
            pytest.param(AttentionOptions(window=16), id="window-a-block"),
            pytest.param(AttentionOptions(window=40, softcap=3.0), id="window-40-softcap"),
            pytest.param(AttentionOptions(softcap=2.0), id="softcap")]


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtypes", DTYPES[:3])
@pytest.mark.parametrize("options", WINDOWED)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (6, 2, 40)])
def test_decode_kernel_slides_a_window_and_caps_scores_as_the_reference(
        march: str, dtypes: tuple[torch.dtype, torch.dtype], options: AttentionOptions, heads: int, kv_heads: int,
        head_dim: int, tiled: bool) -> None:
    """A sliding window (the context's last `window` tokens: blocks before it skipped, the rest of its
    first block masked) and a soft cap on the scores, against the torch reference: contexts shorter
    than the window, ending on and off a block, a padding row. Scaled-up queries push scores past the cap."""
    query_dtype, dtype = dtypes
    seq_lens = [50, 1, 16, 0, 142, 33, 17, 5, 6]
    query, kv_cache, block_tables, lens = paged_case(seq_lens, heads, kv_heads, head_dim, dtype, seed=head_dim,
                                                     query_dtype=query_dtype)
    query = query * 4
    scale = head_dim ** -0.5
    expected = reference.paged_decode_attention(query, kv_cache, block_tables, lens, max(seq_lens), scale, options)
    got = cpu_decode.paged_decode_attention(query, kv_cache, block_tables, lens, max(seq_lens), scale, options,
                                            march=march, tiled=tiled)
    tolerance = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert torch.equal(got[3], torch.zeros_like(got[3])), "a padding row (length 0) must come out zeros"
    whole = reference.paged_decode_attention(query, kv_cache, block_tables, lens, max(seq_lens), scale)
    assert not torch.allclose(got.float(), whole.float(), atol=0.1), "the options must change the answer"
