"""Engine benchmarks, one subcommand each (or `all`); results go to
benchmarks/results/<subcommand>.<machine>.<date>.json and .png.

    python -m benchmarks.engine step-vs-linear --attention sdpa kernels fused   # torch ops against the C kernels
    python -m benchmarks.engine --threads 2 step-vs-linear --kv-cache-dtypes auto fp8 fp8_e5m2  # fp8 KV caches
    python -m benchmarks.engine scheduler-cost
    python -m benchmarks.engine static-vs-continuous --num-requests 500
    python -m benchmarks.engine vs-transformers
    python -m benchmarks.engine preemption
    python -m benchmarks.engine threads        # how much the machine's noise costs 2 threads vs 1
    python -m benchmarks.engine prefill-vs-linear --lengths 512 2048 --attention sdpa kernels fused
    python -m benchmarks.engine --threads 1 decode-kernel   # the C decode kernel alone, its two loops

The default model (SmolLM2-135M-Instruct) is loaded from the local cache; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import torch  # noqa: E402

from benchmarks.common import machine, png_path, print_table, save  # noqa: E402
from cluster.bench import engine_micro as micro  # noqa: E402
from cluster.bench import engine_runs as workloads  # noqa: E402
from cluster.bench import plots  # noqa: E402
from cluster.engine.config import KV_CACHE_DTYPES  # noqa: E402
from cluster.model import elementwise  # noqa: E402
from cluster.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from pdserve_kernels import cpu_decode, torch_prefill  # noqa: E402

MS = 1e3


ATTENTION_CHOICES = ("fused", "fused-chunked", "kernels", "sdpa")
ATTENTION_HELP = ("CPU kernels: fused, fused-chunked (bf16 prompts in chunks even with AMX), kernels (no fused "
                  "elementwise ops) and/or sdpa (torch ops only), alternated")


@contextlib.contextmanager
def cpu_attention(name: str) -> Iterator[str]:
    """CPU kernels for the engines built inside: "fused" (the default: "kernels" plus the fused C
    elementwise ops, `kernels/pdserve_kernels/cpu_fused.c`, the C KV write and the C mask + softmax of bf16 prefill
    chunks; bf16 prompts in SDPA instead of chunks where the CPU has AMX), "fused-chunked" ("fused"
    with the chunks whatever the CPU), "kernels" (the C decode kernel where it builds and chunked bf16
    prefill matmuls, the model's elementwise ops and the chunks' softmax in torch) or "sdpa" (torch
    ops only: gather + grouped matmuls or SDPA)."""
    saved = (TorchAttentionBackend.use_c_kernel, TorchAttentionBackend.use_chunked_prefill, elementwise.use_c_kernels,
             torch_prefill.use_c_softmax)
    fused = name.startswith("fused")
    TorchAttentionBackend.use_c_kernel = name == "kernels" or fused
    TorchAttentionBackend.use_chunked_prefill = None if name == "fused" else name != "sdpa"
    elementwise.use_c_kernels = torch_prefill.use_c_softmax = fused
    try:
        yield name
    finally:
        (TorchAttentionBackend.use_c_kernel, TorchAttentionBackend.use_chunked_prefill, elementwise.use_c_kernels,
         torch_prefill.use_c_softmax) = saved


def step_runs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every dtype under every CPU attention, the arms alternated `--repeats` times (the machine's load
    drifts: alternating lets each see the same)."""
    runs = []
    for repeat in range(args.repeats):
        for dtype in args.dtypes:
            for attention in args.attention:
                for kv_cache_dtype in args.kv_cache_dtypes:
                    with cpu_attention(attention):
                        run = micro.step_vs_linear_one(dtype, args.num_seqs, args.prompt_len, args.iterations,
                                                       args.real_prefill, kv_cache_dtype)
                    runs.append({**run, "attention": attention, "repeat": repeat})
    return runs


def cmd_step_vs_linear(args: argparse.Namespace) -> None:
    info = machine()
    runs = step_runs(args)
    for run in runs:
        parts = run["breakdown_median_s"]
        print_table(f"decode step at {run['num_seqs']} rows, {run['dtype']}, KV {run['kv_cache_dtype']}, "
                    f"attention {run['attention']}: "
                    f"median of {args.iterations} steps", ["part", "ms", "% of step"],
                    [[k, v * MS, 100 * v / run["step_median_s"]] for k, v in parts.items()])
    print_table("step vs linear layers alone", ["dtype", "KV cache", "attention", "step ms", "linear ms",
                                                "ratio (median)", "ratio (min)", "target <= 1.5x"],
                [[r["dtype"], r["kv_cache_dtype"], r["attention"], r["step_median_s"] * MS, r["linear_median_s"] * MS,
                  r["ratio_median"], r["ratio_min"], "met" if r["ratio_median"] <= 1.5 else "MISSED"] for r in runs])
    save("step-vs-linear", {"target": "step <= 1.5x linear layers", "runs": runs, "load_average":
                            os.getloadavg()}, info)
    fp8 = {r["kv_cache_dtype"] for r in runs} - {"float32", "bfloat16"}  # the KV cache named only where it is fp8
    last = {f"{r['dtype']} {r['attention']}" + (f" KV {r['kv_cache_dtype']}" if fp8 else ""): r
            for r in runs if r["repeat"] == args.repeats - 1}
    plots.stacked(png_path("step-vs-linear"), {key: {k: v * MS for k, v in r["breakdown_median_s"].items()}
                                     for key, r in last.items()}, "ms per decode step",
                  f"decode step at {args.num_seqs} rows (dashed: 1.5x linear layers alone)",
                  reference={key: 1.5 * r["linear_median_s"] * MS for key, r in last.items()})


def cmd_scheduler_cost(args: argparse.Namespace) -> None:
    info = machine()
    runs = [micro.scheduler_cost_one(n, args.prompt_len, args.steps, args.real_steps) for n in args.sizes]
    print_table("host cost per decode step, model stubbed (medians, ms)",
                ["running", "schedule", "build_batch", "update", "sum", "p90 sum", "outputs (detok)",
                 "real step", "fraction", "target <= 1 ms"],
                [[r["num_seqs"], r["schedule_median_s"] * MS, r["build_batch_median_s"] * MS,
                  r["update_median_s"] * MS, r["host_median_s"] * MS, r["host_p90_s"] * MS,
                  r["outputs_median_s"] * MS, r["real_step_median_s"] * MS, r["fraction_of_real_step"],
                  "met" if r["host_median_s"] <= 1e-3 else "MISSED"] for r in runs])
    largest = runs[-1]
    print_table(f"Python hot spots at {largest['num_seqs']} running (cProfile, per step)",
                ["function", "calls", "tottime us", "cumtime us"],
                [[h["function"], h["calls_per_step"], h["tottime_us_per_step"], h["cumtime_us_per_step"]]
                 for h in largest["python_hot_spots"][:10]])
    met = all(r["host_median_s"] <= 1e-3 for r in runs if r["num_seqs"] >= 256)
    save("scheduler-cost", {"target": "schedule + build_batch + update <= 1 ms per step at 256 running",
                            "target_met": met, "runs": runs}, info)
    plots.stacked(png_path("scheduler-cost"), {f"{r['num_seqs']} running": {
        "schedule": r["schedule_median_s"] * MS, "build_batch": r["build_batch_median_s"] * MS,
        "update_from_output": r["update_median_s"] * MS, "outputs (detokenize)": r["outputs_median_s"] * MS}
        for r in runs}, "ms per step", "host work per decode step, no model (dashed: 1 ms target)",
        reference={f"{r['num_seqs']} running": 1.0 for r in runs})


def cmd_static_vs_continuous(args: argparse.Namespace) -> None:
    info = machine()
    data = workloads.static_vs_continuous(args.num_requests, args.max_num_seqs, args.kv_gb)
    arms = data["arms"]
    print_table(f"{args.num_requests} requests, max_num_seqs={args.max_num_seqs}, {args.kv_gb} GB KV",
                ["batching", "tokens", "seconds", "tok/s", "mean TTFT s", "p50 TTFT s", "steps", "preemptions"],
                [[k, a["output_tokens"], a["seconds"], a["tokens_per_second"], a["mean_ttft_s"], a["p50_ttft_s"],
                  a["num_steps"], a["num_preemptions"]] for k, a in arms.items()])
    print_table("ratio", ["continuous / static throughput", "target >= 3x"],
                [[data["throughput_ratio"], "met" if data["target_met"] else "MISSED"]])
    save("static-vs-continuous", data, info)
    plots.timelines(png_path("static-vs-continuous"),
                    arms, f"{args.num_requests} requests, max_num_seqs={args.max_num_seqs}")


def cmd_vs_transformers(args: argparse.Namespace) -> None:
    info = machine()
    data = workloads.vs_transformers(args.num_requests, args.batch_size)
    rows = {"pdserve fp32": data["ours"], f"pdserve {data['ours_dtype_auto']['dtype']} (auto)": data["ours_dtype_auto"],
            f"transformers generate (batches of {args.batch_size})": data["transformers_static"],
            "transformers continuous batching": data["transformers_continuous"]}
    print_table(f"{args.num_requests} requests (transformers in fp32)", ["engine", "tokens", "seconds", "tok/s"],
                [[k, r["output_tokens"], r["seconds"], r["tokens_per_second"]] for k, r in rows.items()])
    print_table("ratios", ["ours fp32 / transformers CB", "ours auto / transformers CB", "ours fp32 / static",
                           "target (auto) >= 5x"],
                [[data["ratio_vs_transformers_continuous"], data["ratio_auto_vs_transformers_continuous"],
                  data["ratio_vs_transformers_static"], "met" if data["target_met"] else "MISSED"]])
    save("vs-transformers", data, info)
    labels = {k.replace("transformers ", "transformers\n"): r["tokens_per_second"] for k, r in rows.items()}
    plots.bars(png_path("vs-transformers"),
               labels, "generated tokens / s", f"{args.num_requests} requests, SmolLM2-135M")


def cmd_preemption(args: argparse.Namespace) -> None:
    info = machine()
    data = workloads.preemption(args.num_requests, args.pool_fraction)
    arms = data["arms"]
    print_table(f"{args.num_requests} requests; undersized pool = {data['num_blocks_undersized']} blocks",
                ["mode", "seconds", "tok/s", "preemptions", "steps", "greedy identical to baseline"],
                [[k, a["seconds"], a["tokens_per_second"], a["num_preemptions"], a["num_steps"],
                  "-" if "greedy_vs_baseline" not in a else
                  f"{a['greedy_vs_baseline']['identical']}/{a['greedy_vs_baseline']['total']}"]
                 for k, a in arms.items()])
    save("preemption", data, info)
    plots.timelines(png_path("preemption"),
                    arms, f"{args.num_requests} requests, pool for ~{args.pool_fraction:.0%} of them")


def cmd_prefill_vs_linear(args: argparse.Namespace) -> None:
    info = machine()
    runs = []
    for repeat in range(args.repeats):
        for dtype in args.dtypes:
            for length in args.lengths:
                for attention in args.attention:
                    with cpu_attention(attention):
                        run = micro.prefill_vs_linear_one(dtype, length, args.iterations)
                    runs.append({**run, "attention": attention, "repeat": repeat})
    print_table(f"one prompt in one step vs the linear layers alone on as many rows (medians of {args.iterations})",
                ["dtype", "attention", "tokens", "prefill ms", "linear ms", "prompt tok/s", "fraction of limit",
                 "target >= 50%"],
                [[r["dtype"], r["attention"], r["prompt_len"], r["prefill_median_s"] * MS, r["linear_median_s"] * MS,
                  r["prompt_tokens_per_s"], r["fraction_of_linear_limit"], "met" if r["target_met"] else "MISSED"]
                 for r in runs])
    save("prefill-vs-linear", {"target": "prefill >= 50% of the linear-layer limit", "runs": runs,
                               "load_average": os.getloadavg()}, info)


def decode_kernel_case(in_order: bool, layers: int = 30, seqs: int = 64, context: int = 142) -> tuple[Any, ...]:
    """The default model's decode attention at a 64-row step: 9 query and 3 KV heads of 64, bf16, blocks
    of 16, lengths context-7 .. context; one cache per layer (cycled, so each is read from memory as
    in a step); block tables in pool order (a fresh engine's) or shuffled (a pool after churn)."""
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // 16)
    num_blocks = seqs * blocks_per_seq + 8
    caches = [torch.randn(2, num_blocks, 16, 3, 64, generator=generator).bfloat16() for _ in range(layers)]
    order = torch.arange(num_blocks) if in_order else torch.randperm(num_blocks, generator=generator)
    tables = order[:seqs * blocks_per_seq].view(seqs, blocks_per_seq).contiguous()
    lens = (context - torch.randint(0, 8, (seqs,), generator=generator)).int()
    return torch.randn(seqs, 9, 64, generator=generator).bfloat16(), caches, tables, lens, context


def cmd_decode_kernel(args: argparse.Namespace) -> None:
    """The C decode kernel alone, its two loops alternated (16 tokens at a time, where the build has
    AVX-512 and heads are 64 or 128 wide, and the one-token loop every other CPU runs): CPU time per
    layer (process time over one pass of every layer's cache)."""
    info = machine()
    runs = []
    cases = {"tables in pool order": decode_kernel_case(True), "tables shuffled": decode_kernel_case(False)}
    for case, (query, caches, tables, lens, context) in cases.items():
        times: dict[str, list[float]] = {"one token at a time": [], "16 at a time": []}
        for _ in range(args.repeats):
            for arm in times:
                tiled = arm == "16 at a time"
                start = time.process_time()
                for cache in caches:
                    cpu_decode.paged_decode_attention(query, cache, tables, lens, context, 0.125, tiled=tiled)
                times[arm].append((time.process_time() - start) / len(caches))
        runs += [{"case": case, "arm": arm, "ms_per_layer": [t * MS for t in ts],
                  "median_ms": statistics.median(ts) * MS, "min_ms": min(ts) * MS} for arm, ts in times.items()]
    print_table("C decode kernel per layer, 64 rows x ~142 tokens, bf16, 1 thread (CPU ms)",
                ["block tables", "loop", "median", "min"],
                [[r["case"], r["arm"], r["median_ms"], r["min_ms"]] for r in runs])
    save("decode-kernel", {"runs": runs, "load_average": os.getloadavg()}, info)


def cmd_threads(args: argparse.Namespace) -> None:
    info = machine()
    data = micro.threads_one(args.num_seqs, args.prompt_len, args.counts, args.repeats)
    print_table(f"intra-op threads: decode step at {args.num_seqs} rows and x * y on 1M floats (medians)",
                ["threads", "step ms", "mul ms"],
                [[r["threads"], r["step_median_s"] * MS, r["mul_1m_median_s"] * MS] for r in data["runs"]])
    save("threads", data, info)


def cmd_all(args: argparse.Namespace) -> None:
    # Each with its defaults, unless given here.
    for name in ("step-vs-linear", "scheduler-cost", "static-vs-continuous", "vs-transformers", "preemption"):
        sub = build_parser().parse_args([name, *(["--num-requests", str(args.num_requests)]
                                                  if name == "static-vs-continuous" else [])])
        sub.handler(sub)


def add(commands: Any, name: str, handler: Callable[[argparse.Namespace], None], help_: str) -> Any:
    parser = commands.add_parser(name, help=help_)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    commands = parser.add_subparsers(dest="command", required=True)
    p = add(commands, "step-vs-linear", cmd_step_vs_linear, "decode step vs the model's linear layers alone")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--real-prefill", action="store_true", help="prefill with the model (default: scheduler only)")
    p.add_argument("--attention", nargs="+", choices=ATTENTION_CHOICES, default=["fused"],
                   help=ATTENTION_HELP)
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=list(KV_CACHE_DTYPES),
                   help="KV caches (auto: the model's dtype; fp8 = fp8_e4m3, fp8_e5m2), alternated")
    p.add_argument("--repeats", type=int, default=1, help="alternations of the dtypes and kernels")
    p = add(commands, "scheduler-cost", cmd_scheduler_cost, "host cost per step with the model stubbed")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 256])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--real-steps", type=int, default=4)
    p = add(commands, "static-vs-continuous", cmd_static_vs_continuous, "static vs continuous batching")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-gb", type=float, default=2.0)
    p = add(commands, "vs-transformers", cmd_vs_transformers, "against transformers generate / continuous batching")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p = add(commands, "preemption", cmd_preemption, "recompute vs swap under an undersized KV pool")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--pool-fraction", type=float, default=0.5)
    p = add(commands, "prefill-vs-linear", cmd_prefill_vs_linear, "a prompt's prefill vs the linear layers alone")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--attention", nargs="+", choices=ATTENTION_CHOICES, default=["fused"],
                   help=ATTENTION_HELP)
    p.add_argument("--repeats", type=int, default=1, help="alternations of the dtypes, lengths and arms")
    p = add(commands, "decode-kernel", cmd_decode_kernel, "the C decode kernel, 16 tokens at a time vs one")
    p.add_argument("--repeats", type=int, default=7, help="alternations of the two loops")
    p = add(commands, "threads", cmd_threads, "the same step under 1 and 2 intra-op threads (machine noise)")
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--counts", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=5)
    p = add(commands, "all", cmd_all, "every benchmark, in priority order")
    p.add_argument("--num-requests", type=int, default=500, help="for static-vs-continuous")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.handler(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
