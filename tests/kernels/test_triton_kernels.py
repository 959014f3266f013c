"""The Triton kernels against their torch references, in Triton's interpreter (see conftest.py).

Random shapes: contexts from one token up, lengths off the block size, blocks scattered over the
pool, GQA ratios 1, 3 and 8, head sizes 64/80/96/128, float32/bfloat16/float16, split-K on and off.
Outputs start as NaN so that an element a kernel forgets to write fails the comparison; cache slots
no sequence owns hold a large value, so that a read past a mask wrecks the result. Sizes stay tiny:
the interpreter runs each program op by op in numpy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.model.attention.backend import AttentionMetadata
from cluster.model.attention.registry import get_attention_backend
from cluster.model.attention.torch_backend import TorchAttentionBackend
from cluster.model.attention.triton_backend import TritonAttentionBackend
from cluster.model.cuda_graphs import DecodeGraphs
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from pdserve_kernels import reference, triton_cache, triton_decode, triton_prefill
from pdserve_kernels.reference import CAUSAL, AttentionOptions
from tests.helpers import fp32_model
from tests.triton_mode import interpreting

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
HEAD_LAYOUTS = [(2, 2), (3, 1), (8, 1), (6, 2)]  # (query heads, kv heads): GQA ratios 1, 3, 8 and 3
UNOWNED = 300.0  # what cache slots no sequence owns hold
# Kernels launched on CPU tensors run only in the interpreter; a process with a usable CUDA device
# compiles them instead (tests/triton_mode.py), and tests/model/test_cuda.py runs them on the GPU.
interpreted = pytest.mark.skipif(not interpreting(), reason="Triton kernels are compiled in this process (CUDA)")

# No shrinking: an interpreted example takes a good part of a second, and a failure reports the example
# found; shrinking one could outlast the test timeout.
KERNEL_SETTINGS = settings(deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))
SEQUENCE = st.tuples(st.integers(0, 40), st.integers(1, 20))  # (cached tokens, new tokens)
# Sliding windows from one token to wider than most contexts here, with and without a soft cap.
OPTIONS = st.builds(AttentionOptions, window=st.sampled_from([None, 1, 5, 16, 33]),
                    softcap=st.sampled_from([None, 2.0])).filter(lambda options: options != CAUSAL)
SHAPES = dict(heads=st.sampled_from(HEAD_LAYOUTS), head_dim=st.sampled_from([64, 80, 96, 128]),
              block_size=st.sampled_from([4, 8, 16]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))


@dataclass
class Paged:
    """A batch over a paged cache that already holds every sequence's cached tokens."""

    kv_cache: torch.Tensor
    query: torch.Tensor  # [new tokens, heads, head_dim]
    key: torch.Tensor  # the new tokens' keys and values, not yet in the cache
    value: torch.Tensor
    metadata: AttentionMetadata

    def write_new_tokens(self) -> None:
        reference.write_kv_cache(self.key, self.value, self.kv_cache, self.metadata.slot_mapping)


def build_paged(sequences: list[tuple[int, int]], heads: tuple[int, int], head_dim: int, block_size: int,
                dtype: torch.dtype, seed: int) -> Paged:
    num_heads, num_kv_heads = heads
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-(cached + new) // block_size) for cached, new in sequences]
    num_blocks = sum(blocks) + 2
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), UNOWNED, dtype=dtype)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    permutation = torch.randperm(num_blocks, generator=generator)
    tables, new_slots, first = [], [], 0
    for (cached, new), count in zip(sequences, blocks, strict=True):
        table = permutation[first:first + count]
        first += count
        positions = torch.arange(cached + new)
        slots = table[positions // block_size] * block_size + positions % block_size
        flat[:, slots[:cached]] = torch.randn(2, cached, num_kv_heads, head_dim, generator=generator).to(dtype)
        tables.append(table)
        new_slots.append(slots[cached:])
    block_tables = torch.zeros(len(sequences), max(blocks), dtype=torch.int64)
    for row, table in enumerate(tables):
        block_tables[row, :len(table)] = table
    seq_lens = [cached + new for cached, new in sequences]
    starts = [0]
    for _, new in sequences:
        starts.append(starts[-1] + new)
    tokens = starts[-1]

    def random(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)

    metadata = AttentionMetadata(
        slot_mapping=torch.cat(new_slots), block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        num_decodes=sum(1 for _, new in sequences if new == 1), max_seq_len=max(seq_lens), seq_lens_list=seq_lens,
        query_start_list=starts)
    return Paged(kv_cache, random(num_heads), random(num_kv_heads), random(num_kv_heads), metadata)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# ---- the cache write --------------------------------------------------------------------------------

@interpreted
@settings(KERNEL_SETTINGS, max_examples=12)
@given(tokens=st.integers(1, 12), heads=st.sampled_from(HEAD_LAYOUTS), head_dim=st.sampled_from([64, 80]),
       block_size=st.sampled_from([4, 16]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_cache_write_scatters_like_reference(tokens: int, heads: tuple[int, int], head_dim: int, block_size: int,
                                             dtype: torch.dtype, seed: int) -> None:
    """Keys and values as the model hands them (strided views into one fused projection), slots anywhere
    in the pool, and padding tokens (slot -1) that must leave the cache untouched."""
    num_kv_heads = heads[1]
    generator = torch.Generator().manual_seed(seed)
    num_blocks = -(-tokens // block_size) + 3
    fused = torch.randn(tokens, 3, num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    slots[torch.rand(tokens, generator=generator) < 0.25] = -1
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), UNOWNED, dtype=dtype)
    expected = kv_cache.clone()
    kept = slots >= 0
    reference.write_kv_cache(key[kept], value[kept], expected, slots[kept])
    triton_cache.write_kv_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


# ---- decode -----------------------------------------------------------------------------------------

@interpreted
@settings(KERNEL_SETTINGS, max_examples=30)
@given(seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=3), num_splits=st.sampled_from([1, 2, 3, 5]),
       **SHAPES)
def test_decode_matches_reference(seq_lens: list[int], num_splits: int, heads: tuple[int, int], head_dim: int,
                                  block_size: int, dtype: torch.dtype, seed: int) -> None:
    paged = build_paged([(length - 1, 1) for length in seq_lens], heads, head_dim, block_size, dtype, seed)
    paged.write_new_tokens()
    metadata = paged.metadata
    expected = reference.paged_decode_attention(paged.query, paged.kv_cache, metadata.block_tables,
                                                metadata.seq_lens, metadata.max_seq_len, head_dim ** -0.5)
    out = torch.full_like(paged.query, float("nan"))
    triton_decode.paged_decode_attention(paged.query, paged.kv_cache, metadata.block_tables, metadata.seq_lens,
                                         metadata.max_seq_len, head_dim ** -0.5, out=out, num_splits=num_splits)
    assert_close(out, expected)


@interpreted
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_of_empty_sequence_is_zero(num_splits: int) -> None:
    """Padding rows (a CUDA graph's unused batch slots) have seq_len 0: zeros, and no NaN leaks out."""
    paged = build_paged([(20, 1), (5, 1)], (3, 1), 64, 8, torch.float32, seed=1)
    paged.write_new_tokens()
    metadata = paged.metadata
    seq_lens = torch.tensor([21, 0], dtype=torch.int32)
    out = triton_decode.paged_decode_attention(paged.query, paged.kv_cache, metadata.block_tables, seq_lens, 21,
                                               0.125, num_splits=num_splits)
    expected = reference.paged_decode_attention(paged.query[:1], paged.kv_cache, metadata.block_tables[:1],
                                                seq_lens[:1], 21, 0.125)
    assert_close(out[:1], expected)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_num_splits_fill_idle_devices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_decode, "_parallel_programs", lambda device: 528)
    cuda = torch.device("cuda")
    assert triton_decode.choose_num_splits(1, 8, 32768, cuda) == 32  # 8 programs: as many splits as allowed
    assert triton_decode.choose_num_splits(4, 8, 32768, cuda) == 32  # 17 splits wanted, a power of two taken
    assert triton_decode.choose_num_splits(1, 8, 600, cuda) == 4  # no split under MIN_TOKENS_PER_SPLIT
    assert triton_decode.choose_num_splits(128, 8, 32768, cuda) == 1  # the batch fills the device
    monkeypatch.undo()
    assert triton_decode.choose_num_splits(1, 1, 32768, torch.device("cpu")) == 1


@settings(KERNEL_SETTINGS, max_examples=20)
@given(seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=3), num_splits=st.sampled_from([1, 2, 3]),
       options=OPTIONS, **SHAPES)
def test_decode_slides_its_window_and_caps_scores_as_the_reference(
        seq_lens: list[int], num_splits: int, options: AttentionOptions, heads: tuple[int, int], head_dim: int,
        block_size: int, dtype: torch.dtype, seed: int) -> None:
    """A sliding window (the splits share the window's tokens alone) and a soft cap: contexts shorter
    and longer than the window, split-K on and off."""
    paged = build_paged([(length - 1, 1) for length in seq_lens], heads, head_dim, block_size, dtype, seed)
    paged.write_new_tokens()
    metadata = paged.metadata
    query = paged.query * 4  # scores past the soft cap
    expected = reference.paged_decode_attention(query, paged.kv_cache, metadata.block_tables, metadata.seq_lens,
                                                metadata.max_seq_len, head_dim ** -0.5, options)
    out = torch.full_like(query, float("nan"))
    triton_decode.paged_decode_attention(query, paged.kv_cache, metadata.block_tables, metadata.seq_lens,
                                         metadata.max_seq_len, head_dim ** -0.5, options, out=out,
                                         num_splits=num_splits)
    assert_close(out, expected)


# ---- prefill and extend -----------------------------------------------------------------------------

@interpreted
@settings(KERNEL_SETTINGS, max_examples=24)
@given(sequences=st.lists(SEQUENCE, min_size=1, max_size=3), leading_rows=st.integers(0, 3), **SHAPES)
def test_prefill_matches_reference(sequences: list[tuple[int, int]], leading_rows: int, heads: tuple[int, int],
                                   head_dim: int, block_size: int, dtype: torch.dtype, seed: int) -> None:
    """Fresh prompts (nothing cached) and extends over a cached prefix, in one launch. The sequences'
    rows start after `leading_rows` rows of no sequence (a mixed batch's decodes), left unwritten."""
    paged = build_paged(sequences, heads, head_dim, block_size, dtype, seed)
    paged.write_new_tokens()
    metadata = paged.metadata
    expected = reference.paged_prefill_attention(paged.query, paged.kv_cache, metadata.block_tables,
                                                 metadata.query_start_list, metadata.seq_lens_list, head_dim ** -0.5)
    query = torch.cat([torch.zeros(leading_rows, *paged.query.shape[1:], dtype=dtype), paged.query])
    out = torch.full_like(query, float("nan"))
    max_query_len = max(new for _, new in sequences)
    triton_prefill.paged_prefill_attention(query, paged.kv_cache, metadata.block_tables, metadata.seq_lens,
                                           metadata.query_start_loc + leading_rows, max_query_len,
                                           head_dim ** -0.5, out=out)
    assert out[:leading_rows].isnan().all()
    assert_close(out[leading_rows:], expected)


@settings(KERNEL_SETTINGS, max_examples=20)
@given(sequences=st.lists(SEQUENCE, min_size=1, max_size=3), options=OPTIONS, **SHAPES)
def test_prefill_slides_its_window_and_caps_scores_as_the_reference(
        sequences: list[tuple[int, int]], options: AttentionOptions, heads: tuple[int, int], head_dim: int,
        block_size: int, dtype: torch.dtype, seed: int) -> None:
    """Each new token sees only its window's keys (cached prefix and new tokens alike; rows of one tile
    start seeing at different positions), scores soft-capped."""
    paged = build_paged(sequences, heads, head_dim, block_size, dtype, seed)
    paged.write_new_tokens()
    metadata = paged.metadata
    query = paged.query * 4  # scores past the soft cap
    expected = reference.paged_prefill_attention(query, paged.kv_cache, metadata.block_tables,
                                                 metadata.query_start_list, metadata.seq_lens_list,
                                                 head_dim ** -0.5, options=options)
    out = torch.full_like(query, float("nan"))
    triton_prefill.paged_prefill_attention(query, paged.kv_cache, metadata.block_tables, metadata.seq_lens,
                                           metadata.query_start_loc, max(new for _, new in sequences),
                                           head_dim ** -0.5, options, out=out)
    assert_close(out, expected)


# ---- the backend: cache write, decodes and prefills of one step --------------------------------------

@interpreted
@settings(KERNEL_SETTINGS, max_examples=12)
@given(sequences=st.lists(SEQUENCE | st.tuples(st.integers(0, 40), st.just(1)), min_size=2, max_size=4),
       num_splits=st.sampled_from([None, 3]), options=OPTIONS | st.just(CAUSAL), **SHAPES)
def test_backend_mixed_batch_matches_torch_backend(sequences: list[tuple[int, int]], num_splits: int | None,
                                                   options: AttentionOptions, heads: tuple[int, int], head_dim: int,
                                                   block_size: int, dtype: torch.dtype, seed: int) -> None:
    sequences = sorted(sequences, key=lambda s: s[1] != 1)  # decodes first, as the runner orders them
    paged = build_paged(sequences, heads, head_dim, block_size, dtype, seed)
    expected_cache = paged.kv_cache.clone()
    expected = TorchAttentionBackend().forward(paged.query, paged.key, paged.value, expected_cache, paged.metadata,
                                               head_dim ** -0.5, options)
    out = TritonAttentionBackend(num_splits).forward(paged.query, paged.key, paged.value, paged.kv_cache,
                                                     paged.metadata, head_dim ** -0.5, options)
    assert torch.equal(paged.kv_cache, expected_cache)
    assert_close(out, expected)


# ---- fp8 caches (`kv_cache_dtype`) ---------------------------------------------------------------------

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@interpreted
@settings(KERNEL_SETTINGS, max_examples=16)
@given(sequences=st.lists(SEQUENCE | st.tuples(st.integers(0, 40), st.just(1)), min_size=2, max_size=4),
       fp8=st.sampled_from(FP8), num_splits=st.sampled_from([None, 3]), **SHAPES)
def test_fp8_caches_are_written_and_read_as_the_torch_backend_does(
        sequences: list[tuple[int, int]], fp8: torch.dtype, num_splits: int | None, heads: tuple[int, int],
        head_dim: int, block_size: int, dtype: torch.dtype, seed: int) -> None:
    """A cache of fp8 bytes under a model in `dtype`: the write rounds (and saturates) as torch's cast,
    decodes and prefills widen each byte exactly, against the torch backend on the same cache. A few
    new values lie past fp8's largest (they saturate) and unowned slots hold 300."""
    sequences = sorted(sequences, key=lambda s: s[1] != 1)
    paged = build_paged(sequences, heads, head_dim, block_size, dtype, seed)
    cache = reference.to_cache_dtype(paged.kv_cache, fp8)
    key, value = paged.key, paged.value.clone()
    value[0, 0, :4] = torch.tensor([1e3, -1e3, 7e4, -7e4])  # past e4m3's 448 (and two past e5m2's 57,344)
    expected_cache = cache.clone()
    expected = TorchAttentionBackend().forward(paged.query, key, value, expected_cache, paged.metadata,
                                               head_dim ** -0.5)
    out = TritonAttentionBackend(num_splits).forward(paged.query, key, value, cache, paged.metadata,
                                                     head_dim ** -0.5)
    assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8))
    assert out.dtype == dtype and not out.isnan().any()
    assert_close(out, expected)


@interpreted
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_every_fp8_byte_is_widened_exactly(fp8: torch.dtype) -> None:
    """One token of context: each head's output is that token's value row, so each of the 256 bytes
    (NaNs aside) must come out as torch widens it, through the decode kernel and the prefill kernel."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(fp8).float().isnan()]
    codes = torch.cat([codes, codes[:256 - len(codes)]]).view(4, 64)
    kv_cache = torch.zeros(2, 4, 4, 1, 64, dtype=torch.uint8)
    kv_cache[1, :, 0, 0] = codes  # sequence i's one token: value row i, key 0
    kv_cache = kv_cache.view(fp8)
    expected = codes.view(fp8).float().view(4, 1, 64)
    tables, lens = torch.arange(4).view(4, 1), torch.ones(4, dtype=torch.int32)
    query = torch.randn(4, 1, 64)
    decoded = triton_decode.paged_decode_attention(query, kv_cache, tables, lens, 1, 0.125)
    prefilled = triton_prefill.paged_prefill_attention(query, kv_cache, tables, lens,
                                                       torch.arange(5, dtype=torch.int32), 1, 0.125)
    assert torch.equal(decoded, expected) and torch.equal(prefilled, expected)


@interpreted
def test_auto_backend_on_cpu_is_torch() -> None:
    assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
    assert get_attention_backend("triton", torch.device("cpu")).name == "triton"


# ---- the GPU build ---------------------------------------------------------------------------------------

def compile_for_hopper(kernel: Any, types: dict[str, str], constexprs: dict[str, Any], warps: int) -> None:
    """Lower a kernel to an sm_90 cubin with Triton's bundled ptxas, no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: types.get(name, "constexpr" if name in constexprs else "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    assert compiled.asm["cubin"]


def compile_kernels_for_hopper() -> None:
    """bfloat16 and the Llama-3-8B head layout: GQA group 4, head_dim 128; caches in bf16 and fp8 bytes."""
    import triton.language as tl

    paged = {"query": "*bf16", "cache": "*bf16", "block_tables": "*i64", "seq_lens": "*i32", "out": "*bf16",
             "scale_log2": "fp32"}
    dots = {"DOT_DTYPE": tl.bfloat16, "DOT_PRECISION": "tf32"}
    shape = {"HEAD_DIM": 128, "BLOCK_D": 128}
    decode = {"GROUP": 4, "PAGE_SIZE": 16, "BLOCK_H": 16, "BLOCK_N": 64} | shape | dots
    for fp8, cache in ((0, "*bf16"), (1, "*u8"), (2, "*u8")):  # the model's dtype, fp8 e4m3, e5m2
        compile_for_hopper(triton_decode._decode_split_kernel,
                           paged | {"cache": cache, "partial_out": "*fp32", "partial_lse": "*fp32"},
                           decode | {"SPLIT": True, "FP8": fp8, "SOFTCAP": 0.0}, 8)
        compile_for_hopper(triton_prefill._prefill_kernel, paged | {"cache": cache, "query_start_loc": "*i32"},
                           {"GROUP": 4, "PAGE_SIZE": 16, "BLOCK_M": 64, "BLOCK_N": 64, "FP8": fp8, "SOFTCAP": 0.0}
                           | shape | dots, 8)
    # Gemma 2's soft cap (50) on its scores, in both attention kernels.
    compile_for_hopper(triton_decode._decode_split_kernel, paged | {"partial_out": "*fp32", "partial_lse": "*fp32"},
                       decode | {"SPLIT": False, "FP8": 0, "SOFTCAP": 50.0}, 8)
    compile_for_hopper(triton_prefill._prefill_kernel, paged | {"query_start_loc": "*i32"},
                       {"GROUP": 4, "PAGE_SIZE": 16, "BLOCK_M": 64, "BLOCK_N": 64, "FP8": 0, "SOFTCAP": 50.0}
                       | shape | dots, 8)
    compile_for_hopper(triton_decode._decode_reduce_kernel,
                       {"partial_out": "*fp32", "partial_lse": "*fp32", "out": "*bf16"}, {"BLOCK_S": 32} | shape, 4)
    for cache in ("*bf16", "*u8"):
        compile_for_hopper(triton_cache._write_kernel,
                           {"key": cache, "value": cache, "cache": cache, "slot_mapping": "*i64"},
                           {"KV_HEADS": 8, "BLOCK_H": 8} | shape, 4)


UNINTERPRETED = """
import torch
from cluster.model.attention.registry import get_attention_backend
try:
    get_attention_backend("triton", torch.device("cpu"))
except ValueError as error:
    print("refused:", error)
import tests.kernels.test_triton_kernels as t
t.compile_kernels_for_hopper()
print("compiled for sm_90")
"""


@pytest.fixture(scope="module")
def uninterpreted() -> str:
    """What a process without TRITON_INTERPRET prints: whether the backend takes the CPU, then whether
    the kernels build for sm_90. A process of its own: Triton decides at import whether it interprets,
    and does not compile where it interprets."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default; set to silence Triton 3.9's warning about it
    return subprocess.run([sys.executable, "-c", UNINTERPRETED], env=env, timeout=300, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], check=True).stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a CUDA device the backend needs no interpreter")
def test_triton_backend_on_cpu_without_interpreter_says_what_to_do(uninterpreted: str) -> None:
    assert "refused:" in uninterpreted
    assert "TRITON_INTERPRET=1" in uninterpreted and "attention_backend='torch'" in uninterpreted


def test_kernels_compile_for_hopper(uninterpreted: str) -> None:
    """The compiled path, which the interpreter never lowers (tl.dot operand types and sizes, constexpr
    types), builds for sm_90."""
    assert "compiled for sm_90" in uninterpreted


# ---- the engine ---------------------------------------------------------------------------------------

PREFIX = [5, 17, 33, 9, 81, 120, 7, 7, 64, 11, 3, 250, 199, 42]
PROMPTS = [PREFIX + [18, 77], PREFIX + [100, 101, 102], [200, 201, 202], [44] * 5]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


class EagerReplays(DecodeGraphs):
    """Decode graphs whose 'capture' keeps the forward pass and whose replay reruns it on the static
    buffers: the CUDA graph path's bucketing, padding rows and buffer reuse, on a CPU."""

    replays = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, record=self._record_eagerly, new_pool=lambda: None, **kwargs)

    def _record_eagerly(self, forward: Callable[[], torch.Tensor],
                        pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
        hidden = forward()

        def replay() -> None:
            self.replays += 1
            hidden.copy_(forward())

        return replay, hidden


def greedy_tokens(checkpoint: Path, backend: str, graphs: bool = False,
                  kv_cache_dtype: str = "auto") -> tuple[list[list[int]], LLMEngine]:
    """The first prompt alone, then all of them arriving one per step under a budget that chunks the
    prefills: the second reuses the first's cached prefix blocks (extend attention over them)."""
    engine = LLMEngine(EngineConfig(
        model=fp32_model(checkpoint), cache=CacheConfig(block_size=4, num_blocks=64, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_batched_tokens=6), attention_backend=backend))
    runner = engine.runner
    if graphs:
        runner.decode_graphs = EagerReplays(runner.model, runner.kv_caches, runner.block_tables.table.shape[1],
                                            engine.max_model_len, buckets=(2, 4))
        engine.warm_up()  # captures every bucket, before any request
        assert set(runner.decode_graphs.graphs) == {2, 4}
    outputs = [engine.generate([PROMPTS[0]], GREEDY)[0].token_ids]
    ids: dict[str, int] = {}
    finished: dict[int, list[int]] = {}
    pending = list(enumerate(PROMPTS[1:]))
    while pending or engine.has_unfinished_requests():
        if pending:
            index, prompt = pending.pop(0)
            ids[engine.add_request(prompt, GREEDY).request_id] = index
        for output in engine.step():
            if output.finished:
                finished[ids[output.request_id]] = list(output.token_ids)
    return outputs + [finished[index] for index in range(len(PROMPTS) - 1)], engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"), num_layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def torch_greedy(checkpoint: Path) -> list[list[int]]:
    return greedy_tokens(checkpoint, "torch")[0]


@interpreted
def test_engine_greedy_outputs_match_torch_backend(checkpoint: Path, torch_greedy: list[list[int]]) -> None:
    tokens, engine = greedy_tokens(checkpoint, "triton")
    assert engine.kv_cache.prefix_hits > 0
    assert tokens == torch_greedy


@interpreted
def test_decode_graph_replays_match_torch_backend(checkpoint: Path, torch_greedy: list[list[int]]) -> None:
    """Decode-only steps of 1 to 3 sequences replay in buckets of 2 and 4 captured at warm-up (before
    any request), with padding rows."""
    tokens, engine = greedy_tokens(checkpoint, "triton", graphs=True)
    graphs = engine.runner.decode_graphs
    assert isinstance(graphs, EagerReplays) and set(graphs.graphs) == {2, 4} and graphs.replays > 0
    assert tokens == torch_greedy


@interpreted
def test_engine_greedy_outputs_over_an_fp8_cache_match_torch_backend(checkpoint: Path) -> None:
    """`kv_cache_dtype: fp8` with the Triton backend (decode graphs included): the tokens of the torch
    backend over the same fp8 cache."""
    expected, _ = greedy_tokens(checkpoint, "torch", kv_cache_dtype="fp8")
    tokens, engine = greedy_tokens(checkpoint, "triton", graphs=True, kv_cache_dtype="fp8")
    assert engine.runner.kv_caches[0].dtype == torch.float8_e4m3fn and engine.kv_cache.prefix_hits > 0
    assert tokens == expected
