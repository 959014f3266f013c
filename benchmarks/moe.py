"""The mixture-of-experts MLP on CPUs, three ways over the same routing in one run: the engine's path
(`cluster.model.moe.sorted_experts`: (token, slot) pairs sorted by expert, one gathered copy, each
projection one grouped matmul over the experts' contiguous runs where torch has it), the same sorted
path with its per-expert loop (`sorted-loop`: a matmul pair per chosen expert), and the naive
per-expert masked loop (`masked`, transformers' own: a `where` over the routing per expert, a gather
and an `index_add_` each).

    python -m benchmarks.moe --threads 1                       # bf16 and fp32, the default shapes
    python -m benchmarks.moe --dtypes bfloat16 --tokens 1 64 --repeats 5

Shapes (hidden, experts, top-k, expert width): `mixtral-like` 8 experts, top-2; `qwen3-moe-like` 64
experts, top-8 (Qwen3-30B-A3B has 128 of 768 at hidden 2048: scaled down to fit a small machine).
Per shape, dtype and token count: the median and the fastest of `--repeats` timed calls of each arm
(alternated, after a warm-up call that also checks the arms agree), and each arm's times over the
engine path's. On a shared machine the fastest call is the steadier figure. Writes
benchmarks/results/moe.<machine>.<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional

from benchmarks.common import Cpu, machine, print_table, save
from cluster.model import elementwise, moe
from cluster.model.moe import route

SHAPES = {"mixtral-like": (1024, 8, 2, 1792), "qwen3-moe-like": (1024, 64, 8, 384)}  # hidden, experts, top-k, width
TOKENS = (1, 16, 64, 256, 1024)


def masked_loop(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
    """transformers' loop: for each expert, the (token, slot) pairs that chose it found by a mask."""
    out = torch.zeros_like(x)
    for expert in range(gate_up.shape[0]):
        tokens, slots = torch.where(experts == expert)
        if tokens.numel():
            hidden = elementwise.silu_mul(functional.linear(x[tokens], gate_up[expert]))
            rows = functional.linear(hidden, down[expert]) * weights[tokens, slots, None]
            out.index_add_(0, tokens, rows)
    return out


def sorted_path(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
    """The engine's path: the runs in two grouped matmuls where `moe.grouped_mm_serves`, else the loop."""
    return moe.sorted_experts(x, gate_up, down, weights, experts)


def sorted_loop(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
    """The engine's sorted path with its per-expert loop (a matmul pair per chosen expert)."""
    moe.use_grouped_mm = False
    try:
        return moe.sorted_experts(x, gate_up, down, weights, experts)
    finally:
        moe.use_grouped_mm = True


ARMS: dict[str, Callable[..., torch.Tensor]] = {"sorted": sorted_path, "sorted-loop": sorted_loop,
                                                "masked": masked_loop}


def inputs(shape: tuple[int, int, int, int], tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    hidden, num_experts, top_k, width = shape
    generator = torch.Generator().manual_seed(tokens)
    gate_up = (torch.randn(num_experts, 2 * width, hidden, generator=generator) * hidden ** -0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, width, generator=generator) * width ** -0.5).to(dtype)
    router = torch.randn(num_experts, hidden, generator=generator).to(dtype)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    weights, experts = route(functional.linear(x, router), top_k, renormalize=True)
    return x, gate_up, down, weights, experts


def time_arms(args: tuple[torch.Tensor, ...], repeats: int) -> dict[str, dict[str, float]]:
    """Median and fastest seconds per arm, the arms alternated so that a noisy moment hits them alike."""
    expected = ARMS["sorted"](*args)
    for name, arm in ARMS.items():  # warm-up, and every arm computes the same thing
        torch.testing.assert_close(arm(*args), expected, atol=2e-2, rtol=2e-2, msg=name)
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    for _ in range(repeats):
        for name, arm in ARMS.items():
            started = time.perf_counter()
            arm(*args)
            times[name].append(time.perf_counter() - started)
    return {"median": {name: statistics.median(values) for name, values in times.items()},
            "fastest": {name: min(values) for name, values in times.items()}}


def ratios(seconds: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Each arm's time over the engine path's, by statistic."""
    return {statistic: {name: value / values["sorted"] for name, value in values.items()}
            for statistic, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results: list[dict[str, Any]] = []
    with torch.inference_mode():
        for shape_name in args.shapes:
            for dtype_name in args.dtypes:
                for tokens in args.tokens:
                    x, gate_up, down, weights, experts = inputs(SHAPES[shape_name], tokens, getattr(torch, dtype_name))
                    seconds = time_arms((x, gate_up, down, weights, experts), args.repeats)
                    results.append({"shape": shape_name, "dtype": dtype_name, "tokens": tokens, "seconds": seconds,
                                    "over_sorted": ratios(seconds),
                                    "sorted_takes_grouped_mm": moe.grouped_mm_serves(x, gate_up, down)})
                    print(results[-1], flush=True)
    others = [name for name in ARMS if name != "sorted"]
    for statistic in ("fastest", "median"):
        print_table(f"MoE MLP: {statistic} ms per call, and each arm over the engine's sorted path",
                    ["shape", "dtype", "tokens", *[f"{name} ms" for name in ARMS],
                     *[f"{name} / sorted" for name in others]],
                    [[r["shape"], r["dtype"], r["tokens"], *[1e3 * r["seconds"][statistic][name] for name in ARMS],
                      *[r["over_sorted"][statistic][name] for name in others]] for r in results])
    save("moe", {"shapes": {name: dict(zip(("hidden", "experts", "top_k", "width"), SHAPES[name], strict=True))
                            for name in args.shapes},
                 "cpu_flags": sorted(Cpu.here().flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
                 "results": results}, machine("benchmarks.moe"))


if __name__ == "__main__":
    main()
