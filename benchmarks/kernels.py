"""The Triton paged-attention kernels on a CUDA device: checked against the torch references, then timed.

    python -m benchmarks.kernels [--quick] [--no-engine] [--kv-cache-dtypes auto fp8]

1. Checks: the cache write, decode (split-K off, forced and chosen) and prefill/extend kernels against
   `pdserve_kernels.reference` on random scattered caches, in float32, bfloat16 and float16.
2. Decode: median time over a grid of batch (1..256) x context (512..32k) for the head layouts of
   SmolLM2-135M (9 query heads, 3 kv heads, dim 64) and Llama-3-8B (32, 8, 128), as achieved
   bandwidth (K/V bytes read / time) against a device-to-device copy measured in the same run, with
   the split-K factor chosen and with none.
3. Prefill: the Triton kernel over the paged cache against torch's flash `scaled_dot_product_attention`
   on the same tokens laid out densely, in TFLOP/s.
4. Engine (default model, unless --no-engine): greedy tokens with the torch backend, Triton eager and
   Triton with CUDA graphs of decode steps, which must agree; decode step times with and without graphs.

Times are CUDA-event medians after warm-up, with L2 flushed before each run. The grid is bounded
(batch x context <= 2M tokens) to finish in a few minutes on an H200. Writes
benchmarks/results/kernels-<gpu>.<machine>.<date>.json and .png. Without a CUDA device it says so and exits with 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import console, gpu_slug, machine, print_table, result_path, save
from cluster.bench.plots import pyplot, save_figure
from pdserve_kernels import reference

LAYOUTS = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}  # query heads, kv heads, head dim
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
MAX_TOKENS = 2**21  # batch x context bound: the Llama-3-8B layout's pool stays under 9 GB
PREFILLS = ((1, 512), (1, 2048), (1, 8192), (1, 32768), (8, 2048), (32, 512))  # (batch, prompt length)
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}  # atol, rtol


# ---- timing ------------------------------------------------------------------------------------------

class Timer:
    """Median seconds of a callable between two CUDA events, after warm-up, with L2 flushed first."""

    def __init__(self, warmup: int = 3, iterations: int = 15) -> None:
        self.warmup, self.iterations = warmup, iterations
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def __call__(self, function: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            function()
        times = []
        for _ in range(self.iterations):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)


def copy_bandwidth(timer: Timer, size: int = 2**30) -> float:
    """Bytes per second of a device-to-device copy (read plus write) of `size` bytes."""
    source = torch.empty(size, dtype=torch.int8, device="cuda")
    target = torch.empty_like(source)
    seconds = timer(lambda: target.copy_(source))
    return 2 * size / seconds


# ---- paged inputs ------------------------------------------------------------------------------------

def scattered_tables(seq_lens: list[int], num_blocks: int, device: torch.device) -> torch.Tensor:
    """Block tables drawing each sequence's blocks at random from the whole pool."""
    blocks = [-(-length // BLOCK_SIZE) for length in seq_lens]
    chosen = torch.randperm(num_blocks, device=device)[:sum(blocks)]
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int64, device=device)
    first = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = chosen[first:first + count]
        first += count
    return tables


def random_cache(num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    return torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype)


# ---- 1. checks -----------------------------------------------------------------------------------------

def compare(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, bool]:
    """The largest absolute error, and whether every element is within the dtype's tolerances."""
    atol, rtol = TOLERANCES[expected.dtype]
    ok = bool(torch.isclose(actual, expected, atol=atol, rtol=rtol).all())
    return (actual.float() - expected.float()).abs().max().item(), ok


def check_decode(layout: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                 seq_lens: list[int]) -> dict[str, tuple[float, bool]]:
    from pdserve_kernels import triton_decode

    heads, kv_heads, head_dim = layout
    blocks = sum(-(-length // BLOCK_SIZE) for length in seq_lens) + 8
    cache = random_cache(blocks, kv_heads, head_dim, dtype, device)
    tables = scattered_tables(seq_lens, blocks, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    query = torch.randn(len(seq_lens), heads, head_dim, device=device).to(dtype)
    expected = reference.paged_decode_attention(query, cache, tables, lens, max(seq_lens), head_dim ** -0.5)
    errors = {}
    for label, splits in (("decode", 1), ("decode split 7", 7), ("decode split chosen", None)):
        out = torch.full_like(query, float("nan"))
        triton_decode.paged_decode_attention(query, cache, tables, lens, max(seq_lens), head_dim ** -0.5, out=out,
                                             num_splits=splits)
        errors[label] = compare(out, expected)
    return errors


def check_prefill(layout: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                  sequences: list[tuple[int, int]]) -> dict[str, tuple[float, bool]]:
    """`sequences` as (cached, new) token counts: fresh prompts and extends of a cached prefix."""
    from pdserve_kernels import triton_prefill

    heads, kv_heads, head_dim = layout
    seq_lens = [cached + new for cached, new in sequences]
    blocks = sum(-(-length // BLOCK_SIZE) for length in seq_lens) + 8
    cache = random_cache(blocks, kv_heads, head_dim, dtype, device)
    tables = scattered_tables(seq_lens, blocks, device)
    starts = [0]
    for _, new in sequences:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], heads, head_dim, device=device).to(dtype)
    expected = reference.paged_prefill_attention(query, cache, tables, starts, seq_lens, head_dim ** -0.5)
    out = torch.full_like(query, float("nan"))
    triton_prefill.paged_prefill_attention(
        query, cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device), max(new for _, new in sequences), head_dim ** -0.5,
        out=out)
    return {"prefill": compare(out, expected)}


def check_cache_write(layout: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                      tokens: int) -> dict[str, tuple[float, bool]]:
    from pdserve_kernels import triton_cache

    _, kv_heads, head_dim = layout
    blocks = -(-tokens // BLOCK_SIZE) + 8
    cache = random_cache(blocks, kv_heads, head_dim, dtype, device)
    expected = cache.clone()
    key, value = (torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype) for _ in range(2))
    slots = torch.randperm(blocks * BLOCK_SIZE, device=device)[:tokens]
    slots[::5] = -1  # padding tokens: skipped
    kept = slots >= 0
    reference.write_kv_cache(key[kept], value[kept], expected, slots[kept])
    triton_cache.write_kv_cache(key, value, cache, slots)
    return {"cache write": compare(cache, expected)}


def run_checks(device: torch.device, scale: int = 1) -> list[dict[str, Any]]:
    """Every kernel, layout and dtype; `scale` divides the lengths (small for an interpreter dry run)."""
    rows = []
    for name, layout in LAYOUTS.items():
        for dtype in TOLERANCES:
            torch.manual_seed(0)
            errors = check_cache_write(layout, dtype, device, 1000 // scale)
            errors |= check_decode(layout, dtype, device, [1, 17, 3000 // scale, 700 // scale, 2048 // scale])
            errors |= check_prefill(layout, dtype, device, [(0, 1), (0, 900 // scale), (1500 // scale, 300 // scale),
                                                            (33, 1), (0, 70)])
            for kernel, (error, ok) in errors.items():
                rows.append({"layout": name, "dtype": str(dtype).removeprefix("torch."), "kernel": kernel,
                             "max_abs_error": error, "ok": ok})
    return rows


# ---- 2. decode -------------------------------------------------------------------------------------------

def decode_grid(quick: bool) -> list[tuple[int, int]]:
    batches, contexts = ((1, 16, 256), (512, 8192)) if quick else (BATCHES, CONTEXTS)
    return [(b, c) for b in batches for c in contexts if b * c <= MAX_TOKENS]


def time_decode_layout(name: str, grid: list[tuple[int, int]], timer: Timer, copy: float,
                       kv_cache_dtype: torch.dtype = DTYPE) -> list[dict[str, Any]]:
    """Decode over a cache of the model's dtype, or of fp8 (`--kv-cache-dtypes`: half the bytes to read)."""
    from pdserve_kernels import triton_decode

    heads, kv_heads, head_dim = LAYOUTS[name]
    num_blocks = max(b * -(-c // BLOCK_SIZE) for b, c in grid) + 16
    cache = reference.to_cache_dtype(random_cache(num_blocks, kv_heads, head_dim, DTYPE, torch.device("cuda")),
                                     kv_cache_dtype)
    rows = []
    for batch, context in grid:
        tables = scattered_tables([context] * batch, num_blocks, cache.device)
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        query = torch.randn(batch, heads, head_dim, device="cuda", dtype=DTYPE)
        out = torch.empty_like(query)
        splits = triton_decode.choose_num_splits(batch, kv_heads, context, cache.device)

        def decode(num_splits: int | None, tables: torch.Tensor = tables, lens: torch.Tensor = lens,
                   query: torch.Tensor = query, out: torch.Tensor = out, context: int = context) -> None:
            triton_decode.paged_decode_attention(query, cache, tables, lens, context, head_dim ** -0.5, out=out,
                                                 num_splits=num_splits)

        seconds = timer(lambda: decode(None))
        unsplit = timer(lambda: decode(1)) if splits > 1 else seconds
        kv_bytes = 2 * batch * context * kv_heads * head_dim * cache.element_size()
        rows.append({"layout": name, "kv_cache_dtype": str(cache.dtype).removeprefix("torch."), "batch": batch,
                     "context": context, "splits": splits, "seconds": seconds,
                     "unsplit_seconds": unsplit, "bandwidth_gbs": kv_bytes / seconds / 1e9,
                     "fraction_of_copy": kv_bytes / seconds / copy})
        console.print(f"  decode {name} {cache.dtype} batch {batch:>3} context {context:>5}: {seconds * 1e6:8.1f} us, "
                      f"{kv_bytes / seconds / 1e9:7.1f} GB/s ({splits} splits; unsplit {unsplit * 1e6:.1f} us)")
    return rows


# ---- 3. prefill ------------------------------------------------------------------------------------------

def time_prefill(name: str, batch: int, length: int, timer: Timer) -> dict[str, Any]:
    from pdserve_kernels import triton_prefill

    heads, kv_heads, head_dim = LAYOUTS[name]
    tokens, scale = batch * length, head_dim ** -0.5
    cache = random_cache(tokens // BLOCK_SIZE + 16, kv_heads, head_dim, DTYPE, torch.device("cuda"))
    tables = scattered_tables([length] * batch, cache.shape[1], cache.device)
    query = torch.randn(tokens, heads, head_dim, device="cuda", dtype=DTYPE)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, tokens + 1, length, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    triton_seconds = timer(lambda: triton_prefill.paged_prefill_attention(query, cache, tables, lens, starts, length,
                                                                           scale, out=out))
    # The same keys and values, dense, each kv head repeated for its query heads (flash takes no GQA).
    keys, values = reference.gather_kv(cache, tables, length)
    keys, values = (x.repeat_interleave(heads // kv_heads, dim=1).contiguous() for x in (keys, values))
    dense_query = query.view(batch, length, heads, head_dim).transpose(1, 2).contiguous()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        flash_seconds = timer(lambda: F.scaled_dot_product_attention(dense_query, keys, values, is_causal=True,
                                                                     scale=scale))
    flops = 2 * batch * heads * length * length * head_dim  # causal: half of 4 * b * h * n^2 * d
    row = {"layout": name, "batch": batch, "length": length, "triton_seconds": triton_seconds,
           "flash_seconds": flash_seconds, "triton_tflops": flops / triton_seconds / 1e12,
           "flash_tflops": flops / flash_seconds / 1e12}
    console.print(f"  prefill {name} batch {batch:>2} x {length:>5}: triton {triton_seconds * 1e3:8.2f} ms "
                  f"({row['triton_tflops']:.0f} TFLOP/s), flash {flash_seconds * 1e3:8.2f} ms "
                  f"({row['flash_tflops']:.0f} TFLOP/s)")
    return row


# ---- 4. the engine: CUDA graphs of decode steps ----------------------------------------------------------

def engine_arm(backend: str, graphs: bool, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt (batched), and the median decode step time."""
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
    from cluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=ModelConfig(device="cuda"), cache=CacheConfig(kv_cache_memory_gb=1.0),
                                    attention_backend=backend))
    if not graphs:
        engine.runner.decode_graphs = None
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt, params).request_id for prompt in prompts]
    tokens: dict[str, list[int]] = {}
    step_times = []
    while engine.has_unfinished_requests():
        scheduler = engine.scheduler
        decoding = not scheduler.waiting and all(r.num_tokens - r.num_computed_tokens == 1 for r in scheduler.running)
        start = time.perf_counter()
        outputs = engine.step()
        if decoding:
            step_times.append(time.perf_counter() - start)
        tokens |= {output.request_id: list(output.token_ids) for output in outputs if output.finished}
    return [tokens[request_id] for request_id in ids], statistics.median(step_times[3:] or step_times or [0.0])


def run_engine(quick: bool) -> dict[str, Any]:
    from cluster.common.errors import ModelLoadError

    prompts = [[1 + (7 * i + 3 * j) % 1000 for j in range(20 + 9 * i)] for i in range(8)]
    max_tokens = 16 if quick else 48
    try:
        arms = {label: engine_arm(backend, graphs, prompts, max_tokens) for label, backend, graphs in
                (("torch", "torch", False), ("triton eager", "triton", False), ("triton graphs", "triton", True))}
    except ModelLoadError as error:
        console.print(f"[yellow]engine check skipped: {error}")
        return {"skipped": str(error)}
    expected = arms["torch"][0]
    result = {label: {"tokens_match_torch": tokens == expected, "decode_step_seconds": step}
              for label, (tokens, step) in arms.items()}
    for label, arm in result.items():
        console.print(f"  engine {label}: decode step {arm['decode_step_seconds'] * 1e3:.2f} ms, "
                      f"tokens match torch: {arm['tokens_match_torch']}")
    return result


# ---- report --------------------------------------------------------------------------------------------

def plot(name: str, decode: list[dict[str, Any]], prefill: list[dict[str, Any]], copy: float, gpu: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    kv_dtypes = sorted({row["kv_cache_dtype"] for row in decode})
    for (layout, style) in zip(LAYOUTS, ("-", "--"), strict=True):
        for kv, marker in zip(kv_dtypes, "os^", strict=False):
            for batch in sorted({row["batch"] for row in decode}):
                rows = [row for row in decode
                        if (row["layout"], row["batch"], row["kv_cache_dtype"]) == (layout, batch, kv)]
                if rows:
                    left.plot([r["context"] for r in rows], [r["bandwidth_gbs"] for r in rows], style, marker=marker,
                              label=f"{layout} batch {batch}" + (f" KV {kv}" if len(kv_dtypes) > 1 else ""))
    left.axhline(copy / 1e9, color="black", linestyle=":", label="device copy")
    left.set(xscale="log", xlabel="context (tokens)", ylabel="K/V read (GB/s)", title=f"decode on {gpu}")
    left.legend(fontsize=7, ncol=2)
    labels = [f"{r['layout'].split('-')[0]} {r['batch']}x{r['length']}" for r in prefill]
    positions = range(len(prefill))
    right.bar([p - 0.2 for p in positions], [r["triton_tflops"] for r in prefill], 0.4, label="triton (paged)")
    right.bar([p + 0.2 for p in positions], [r["flash_tflops"] for r in prefill], 0.4, label="torch flash (dense)")
    right.set_xticks(list(positions), labels, rotation=30, ha="right", fontsize=8)
    right.set(ylabel="TFLOP/s", title="causal prefill")
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    save_figure(fig, result_path(name, ".png"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller grid, for a smoke run")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine and CUDA graph check")
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=["auto", "fp8", "fp8_e5m2"],
                        help="decode timed over caches of the model's dtype (auto) and/or fp8 (e4m3, e5m2)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels needs a CUDA device and none is visible (torch.cuda.is_available() is False); "
              "the kernels' CPU checks are the tests: pytest tests/kernels", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: unset it to time compiled kernels", file=sys.stderr)
        return 2
    started = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    console.print(f"[bold]{gpu}[/bold]: checking the kernels against the references")
    checks = run_checks(torch.device("cuda"))
    print_table("checks", ["layout", "dtype", "kernel", "max abs error", "ok"],
                [[r["layout"], r["dtype"], r["kernel"], r["max_abs_error"], str(r["ok"])] for r in checks])
    timer = Timer()
    copy = copy_bandwidth(timer)
    console.print(f"device-to-device copy: {copy / 1e9:.0f} GB/s")
    kv_dtypes = {"auto": DTYPE, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    decode = [row for kv in args.kv_cache_dtypes for name in LAYOUTS
              for row in time_decode_layout(name, decode_grid(args.quick), timer, copy, kv_dtypes[kv])]
    prefill = [time_prefill(name, batch, length, timer) for name in LAYOUTS
               for batch, length in (PREFILLS[:3] if args.quick else PREFILLS)]
    engine = {} if args.no_engine else run_engine(args.quick)
    info = machine() | {"gpu": gpu, "cuda": torch.version.cuda, "command": "python -m benchmarks.kernels " +
                        " ".join(argv if argv is not None else sys.argv[1:])}
    name = f"kernels-{gpu_slug(gpu)}"
    save(name, {"checks": checks, "copy_bandwidth_gbs": copy / 1e9, "decode": decode, "prefill": prefill,
                "engine": engine, "seconds": time.perf_counter() - started}, info)
    plot(name, decode, prefill, copy, gpu)
    failed = [r for r in checks if not r["ok"]] + [a for a in engine.values() if isinstance(a, dict)
                                                   and not a.get("tokens_match_torch", True)]
    console.print(f"done in {time.perf_counter() - started:.0f} s; " +
                  (f"[red]{len(failed)} checks failed" if failed else "[green]every check passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
