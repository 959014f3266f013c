"""The fused CPU elementwise kernels (`kernels/pdserve_kernels/cpu_fused.c`) against the torch ops of
`kernels/pdserve_kernels/reference.py`, in fp32 and bf16, at odd sizes (vector loops and their scalar tails), for
this CPU's build, a build for an AVX2-only CPU (`x86-64-v3`: the plain-C path CI machines without
AVX-512 take) and one for an AVX-512 CPU without AVX512-BF16 (`skylake-avx512`, where AVX-512 runs)."""

from __future__ import annotations

import platform

import pytest
import torch

from pdserve_kernels import cpu_build, cpu_fused, reference

pytestmark = pytest.mark.skipif(not cpu_fused.available(torch.float32), reason="no C compiler on this machine")

X86 = platform.machine() in ("x86_64", "AMD64")
AVX512 = "avx512f" in cpu_build.cpu_flags().split()
# This CPU's build, an AVX2-only CPU's (plain C) and, where AVX-512 runs, an AVX-512 CPU's without bf16.
MARCHES = ["native", pytest.param("x86-64-v3", marks=pytest.mark.skipif(not X86, reason="x86 only")),
           pytest.param("skylake-avx512", marks=pytest.mark.skipif(not AVX512, reason="no AVX-512 here"))]
# bf16: one rounding apart at most where a sum's order differs (bf16 has 8 bits of mantissa).
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1e-2, "rtol": 8e-3}}
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "size"), [(64, 576), (3, 37), (300, 256)])
def test_add_rms_norm_matches_the_reference(march: str, dtype: torch.dtype, rows: int, size: int) -> None:
    x, residual, weight = randn(rows, size, dtype=dtype, seed=1), randn(rows, size, dtype=dtype, seed=2), \
        randn(size, dtype=dtype, seed=3)
    for res in (residual, None):
        out, summed = cpu_fused.add_rms_norm(x, res, weight, 1e-5, march=march)
        want_out, want_summed = reference.add_rms_norm(x, res, weight, 1e-5)
        assert torch.equal(summed, want_summed), "the residual sum rounds as torch's add does"
        torch.testing.assert_close(out, want_out, **TOLERANCE[dtype])


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "size"), [(64, 1536), (5, 23)])
def test_silu_mul_matches_the_reference(march: str, dtype: torch.dtype, rows: int, size: int) -> None:
    gate_up = randn(rows, 2 * size, dtype=dtype, seed=4)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # e^x's range ends: no inf, no NaN
    got = cpu_fused.silu_mul(gate_up, march=march)
    torch.testing.assert_close(got, reference.silu_mul(gate_up), **TOLERANCE[dtype])


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 40)])
def test_rotary_matches_the_reference(march: str, dtype: torch.dtype, heads: int, kv_heads: int,
                                      head_dim: int) -> None:
    """The query and key heads at the front of each qkv row (the values after them left alone)."""
    rows = 19
    qkv = randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5)
    angles = torch.rand(rows, 1, head_dim // 2, generator=torch.Generator().manual_seed(6)) * 50
    cos, sin = angles.cos(), angles.sin()
    rotated_heads = heads + kv_heads
    got = cpu_fused.rotary(qkv, rotated_heads, head_dim, cos, sin, march=march)
    want = reference.rotary(qkv[:, :rotated_heads * head_dim].view(rows, rotated_heads, head_dim), cos, sin)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize(("rows", "cols", "visible", "repeat"),
                         [(768, 700, 445, 3), (5, 33, 1, 1), (4, 6, 9, 2),
                          (6, 8300, 8190, 3), (2, 8300, 8200, 1)])  # rows of scores on the stack, then the heap
def test_causal_softmax_matches_the_reference(march: str, rows: int, cols: int, visible: int, repeat: int) -> None:
    """Row i sees `visible + i // repeat` keys (capped at cols); what it does not see comes out 0."""
    scores = randn(rows, cols, dtype=torch.bfloat16, seed=7) * 4
    want = reference.causal_softmax(scores, visible, repeat)
    got = cpu_fused.causal_softmax_(scores.clone(), visible, repeat, march=march)
    torch.testing.assert_close(got, want, atol=4e-3, rtol=8e-3)
    seen = torch.arange(cols)[None, :] < (visible + torch.arange(rows) // repeat)[:, None]
    assert not got[~seen].any(), "a key past the query's position must get probability 0"


def test_the_avx2_build_takes_the_plain_path() -> None:
    """A CPU without AVX-512 (CI) gets code built without it: the build says which path it took."""
    if not X86:
        pytest.skip("x86 only")
    assert cpu_fused.isa("x86-64-v3") == "plain C"
    if AVX512:
        assert cpu_fused.isa("skylake-avx512") == "AVX-512"
    flags = set(cpu_build.cpu_flags().split())
    expected = "AVX-512 + AVX512-BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else "plain C"
    assert cpu_fused.isa() == expected


def test_the_kernels_refuse_what_they_cannot_read() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_fused.add_rms_norm(x.T, None, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_fused.add_rms_norm(x, None, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="heads"):
        cpu_fused.rotary(x, 2, 8, torch.ones(4, 4), torch.ones(4, 4))


@pytest.mark.parametrize("march", MARCHES)
def test_argmax_rows_is_torchs_argmax_on_the_widened_logits(march: str) -> None:
    """Exact, ties included: the first maximum, -0 == +0, a NaN wins (its first one); strided rows."""
    logits = randn(9, 1000, dtype=torch.bfloat16, seed=8)[:, :997]  # rows 1000 apart, 997 columns
    logits[1, [3, 500, 996]] = 50.0  # a three-way tie: the first
    logits[2] = -1.0  # all equal
    logits[3, 10], logits[3, 20] = -0.0, 0.0  # -0 and +0 tie as the maximum of a negative row
    logits[3] = torch.where(logits[3] == 0, logits[3], -logits[3].abs() - 1)
    logits[4, 700], logits[4, 900] = float("nan"), float("nan")
    logits[5] = float("-inf")
    logits[6, 996] = float("inf")
    logits[7, 0] = 60.0  # the very first column
    got = cpu_fused.argmax_rows(logits, march=march)
    assert got.tolist() == logits.float().argmax(dim=-1).tolist()
    assert got.tolist()[1:5] == [3, 0, 10, 700]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_the_reference(dtype: torch.dtype) -> None:
    """The step's keys and values as the model hands them over (views into one row of rotated q + k and
    one of qkv: rows strided) land in out-of-order slots as `reference.write_kv_cache` puts them."""
    tokens, heads, kv_heads, dim, blocks, block_size = 21, 9, 3, 64, 7, 4
    rotated = torch.randn(tokens, heads + kv_heads, dim).to(dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    key = rotated[:, heads:]
    value = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * block_size)[:tokens]
    expected = torch.randn(2, blocks, block_size, kv_heads, dim).to(dtype)
    got = expected.clone()
    reference.write_kv_cache(key, value, expected, slots)
    cpu_fused.write_kv_cache(key, value, got, slots)
    assert torch.equal(got, expected)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def every_bf16_pattern(dtype: torch.dtype, low_bits: torch.Tensor | None = None) -> torch.Tensor:
    """All 65,536 bf16 bit patterns (zeros, subnormals, every binade, infinities, NaNs), as bf16 or
    as fp32 with `low_bits` below them (what decides a rounding past bf16's mantissa)."""
    patterns = torch.arange(1 << 16, dtype=torch.int32)
    if dtype == torch.bfloat16:
        return patterns.to(torch.int16).view(torch.bfloat16)
    return ((patterns << 16) | (0 if low_bits is None else low_bits)).view(torch.float32)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 64), (3, 40)])
def test_write_kv_cache_rounds_every_value_to_fp8_as_torch_does(march: str, fp8: torch.dtype, dtype: torch.dtype,
                                                                 kv_heads: int, head_dim: int) -> None:
    """An fp8 cache written from bf16 or fp32 rows in one call holds, byte for byte, what torch's clamp and
    cast (`reference.to_cache_dtype`) make of every bf16 value: ties to even, subnormals, saturation
    at the format's largest, infinities, NaN (a NaN's sign aside), -0; fp32 keys carry random low bits
    (rounding past a tie) and fp32 values the bit just below bf16's (a sticky bit). Rows of 120 leave
    scalar tails."""
    generator = torch.Generator().manual_seed(5)
    key = every_bf16_pattern(dtype, torch.randint(0, 1 << 16, (1 << 16,), dtype=torch.int32, generator=generator))
    shuffle = torch.randperm(1 << 16, generator=generator)
    value = every_bf16_pattern(dtype, torch.tensor(0x8000, dtype=torch.int32))[shuffle]
    row = kv_heads * head_dim
    tokens = -(-key.numel() // row)
    key, value = (torch.cat([x, x[: tokens * row - x.numel()]]).view(tokens, kv_heads, head_dim) for x in (key, value))
    block_size = 16
    blocks = -(-tokens // block_size) + 2
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    got = torch.zeros(2, blocks, block_size, kv_heads, head_dim, dtype=fp8)
    cpu_fused.write_kv_cache(key, value, got, slots, march=march)
    expected = torch.zeros_like(got)
    reference.write_kv_cache(key, value, expected, slots)  # torch: clamp, cast, index_copy_
    both_nan = got.float().isnan() & expected.float().isnan()  # torch's bf16 clamp flips some NaNs' sign
    mismatch = ((got.view(torch.uint8) != expected.view(torch.uint8)) & ~both_nan).nonzero()
    assert mismatch.shape[0] == 0, f"{mismatch.shape[0]} bytes differ, first at {mismatch[0].tolist()}"


def test_write_kv_cache_refuses_a_slot_outside_the_cache() -> None:
    key = value = torch.randn(2, 3, 64)
    cache = torch.zeros(2, 4, 16, 3, 64)
    for bad in (64, -1):
        with pytest.raises(IndexError, match="slot"):
            cpu_fused.write_kv_cache(key, value, cache, torch.tensor([5, bad]))
        assert not cache.any(), "nothing written when a slot is out of range"
    with pytest.raises(ValueError, match="dtype"):
        cpu_fused.write_kv_cache(key.bfloat16(), value, cache, torch.tensor([5, 6]))
