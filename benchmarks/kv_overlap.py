"""What sending the KV while the prompt computes buys: overlap on versus off, same run.

    python -m benchmarks.kv_overlap [--lengths 512 1024 2048] [--repeats 3] [--chunk 256]

One prefill and one decode worker (Ray actors, one torch thread each, KV over UCX/TCP), the default
model, one long request at a time (nothing else running: the transfer's own cost, not queueing).
The prefill worker computes each prompt in chunks of `--chunk` tokens (its token budget). Arms:
- `at-end` (kv_overlap: false): the prompt's KV leaves in one frame once the first token is sampled;
- `overlap` (kv_overlap: true, the default): each chunk's finished blocks leave while the next
  chunk computes; only the last block (with the first token) is left at the end.

Per request: TTFT (arrival to the first token, from the prefill worker), the gap to the second
token (the exposed transfer, the decode worker's admission and one decode step), and the prefill
worker's `TransferStats`: bytes, frames, seconds on the wire, and `exposed_s` (the last frame's
send, i.e. the part of the transfer after the prefill finished). The arms alternate per repeat so
the machine's drifting load hits both alike. Results: benchmarks/results/kv-overlap.<machine>.<date>.json and .png.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and Ray: the workers inherit it
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import RESULTS, console, machine, print_table, result_path  # noqa: E402
from cluster.common.sampling_params import SamplingParams  # noqa: E402
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from  # noqa: E402
from cluster.ray_cluster.launcher import Cluster, init_ray  # noqa: E402

NAME = "kv-overlap"
ARMS = {"at-end": False, "overlap": True}


def start(overlap: bool, args: argparse.Namespace) -> Cluster:
    engine = engine_config_from({"kv_cache_memory_gb": args.kv_cache_gb, "max_num_batched_tokens": args.chunk})
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.25), decode=PoolConfig(replicas=1, num_cpus=0.25),
                           engine=engine, kv_overlap=overlap)
    return Cluster(config).start()


async def one(cluster: Cluster, prompt: list[int], request_id: str) -> dict[str, float]:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    arrival, times = time.perf_counter(), []
    async for event in cluster.generate(prompt, params, request_id=request_id):
        times += [time.perf_counter() - arrival] * len(event.token_ids)
    return {"ttft_s": times[0], "second_token_gap_s": times[1] - times[0]}


async def measure(cluster: Cluster, prompt: list[int], request_id: str) -> dict[str, Any]:
    result: dict[str, Any] = await one(cluster, prompt, request_id)
    transfers = await cluster.prefill[0].transfers.remote()
    stats = next(t for t in transfers if t.request_id == request_id)
    result.update(nbytes=stats.nbytes, frames=stats.frames, wire_s=stats.seconds, exposed_s=stats.exposed_s,
                  gb_per_s=stats.gb_per_s)
    return result


def run(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    rng = np.random.default_rng(args.seed)
    prompts = {length: rng.integers(1000, 30000, length).tolist() for length in args.lengths}
    clusters = {arm: start(overlap, args) for arm, overlap in ARMS.items()}
    rows: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    try:
        for arm, cluster in clusters.items():  # warm up: first calls load kernels and connect UCX
            asyncio.run(one(cluster, rng.integers(1000, 30000, 300).tolist(), f"warm-{arm}"))
        for repeat in range(args.repeats):
            for length, prompt in prompts.items():
                order = list(ARMS) if repeat % 2 == 0 else list(reversed(ARMS))
                for arm in order:
                    # Prefix caching would make repeats free: vary the first token per repeat and arm.
                    varied = [prompt[0] + 1 + repeat * 2 + order.index(arm), *prompt[1:]]
                    result = asyncio.run(measure(clusters[arm], varied, f"{arm}-{length}-{repeat}"))
                    rows[arm].append({"prompt_tokens": length, "repeat": repeat, **result})
                    console.print(f"{arm:8s} {length:5d} tokens: TTFT {result['ttft_s'] * 1e3:7.1f} ms, "
                                  f"2nd-token gap {result['second_token_gap_s'] * 1e3:6.1f} ms, "
                                  f"{result['frames']} frames, exposed {result['exposed_s'] * 1e3:6.1f} ms")
    finally:
        for cluster in clusters.values():
            cluster.stop()
    return rows


def summarize(rows: dict[str, list[dict[str, Any]]], lengths: list[int]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for length in lengths:
        by_arm = {arm: [r for r in arm_rows if r["prompt_tokens"] == length] for arm, arm_rows in rows.items()}
        med = {arm: {key: statistics.median(r[key] for r in rs) for key in
                     ("ttft_s", "second_token_gap_s", "exposed_s", "wire_s", "frames", "nbytes")}
               for arm, rs in by_arm.items()}
        summary[str(length)] = {"median": med, "gap_ratio_at_end_over_overlap":
                                med["at-end"]["second_token_gap_s"] / med["overlap"]["second_token_gap_s"],
                                "ttft_ratio_overlap_over_at_end": med["overlap"]["ttft_s"] / med["at-end"]["ttft_s"]}
    return summary


def plot(summary: dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for offset, arm in ((-width / 2, "at-end"), (width / 2, "overlap")):
        xs = [i + offset for i in range(len(lengths))]
        axes[0].bar(xs, [summary[n]["median"][arm]["second_token_gap_s"] * 1e3 for n in lengths], width, label=arm)
        axes[1].bar(xs, [summary[n]["median"][arm]["ttft_s"] * 1e3 for n in lengths], width, label=arm)
    for ax, title in zip(axes, ("first to second token (ms, median)", "time to first token (ms, median)"),
                         strict=True):
        ax.set_xticks(range(len(lengths)), [f"{n} tokens" for n in lengths])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("KV sent while the prompt computes vs at its end (1 prefill + 1 decode worker, UCX/TCP)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=256, help="prefill token budget per step")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    init_ray()
    info = machine("benchmarks.kv_overlap")
    rows = run(args)
    summary = summarize(rows, args.lengths)
    print_table("KV transfer overlapped with compute (medians)",
                ["prompt", "arm", "TTFT ms", "2nd-token gap ms", "exposed ms", "wire ms", "frames", "MB"],
                [[n, arm, f"{m['ttft_s'] * 1e3:.0f}", f"{m['second_token_gap_s'] * 1e3:.1f}",
                  f"{m['exposed_s'] * 1e3:.1f}", f"{m['wire_s'] * 1e3:.1f}", f"{m['frames']:.0f}",
                  f"{m['nbytes'] / 1e6:.1f}"]
                 for n, s in summary.items() for arm, m in s["median"].items()])
    for n, s in summary.items():
        console.print(f"{n} tokens: 2nd-token gap at-end/overlap = {s['gap_ratio_at_end_over_overlap']:.2f}x, "
                      f"TTFT overlap/at-end = {s['ttft_ratio_overlap_over_at_end']:.2f}x")
    if args.no_save:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(NAME)
    path.write_text(json.dumps({"benchmark": NAME, "machine": info, "workload": vars(args), "summary": summary,
                                "rows": rows}, indent=1) + "\n")
    plot(summary, result_path(NAME, ".png"))
    console.print(f"[green]wrote {path}")


if __name__ == "__main__":
    main()
