"""The planner's simulator against real clusters on this machine (issue 22, item 2).

    python -m benchmarks.planner_validation [--rate 0.5] [--num-requests 40] [--profile PROFILE.json]

1. Profile: one engine of the default model in this process, one torch thread (each worker below
   gets one: `threads: 1`), on a grid sized to the workload (`GRID`); or `--profile` to reuse one.
2. For each configuration (colocated x1, colocated x2, 1P+1D by default; `--configs`), start the
   real cluster (embedded Ray, UCX between the pools), warm it up, and replay the workload: Poisson
   arrivals at `--rate`, prompts of 64-256 random ids, 16-64 output tokens (greedy, EOS ignored),
   every token event timestamped at the client (`benchmarks.disaggregation.one`).
3. Simulate the same requests on the same topology from the profile, and compare TTFT, ITL and
   TPOT p50/p90, predicted against measured.
Results: benchmarks/results/planner-validation.json and .png (predicted against measured, with the
±25% band). About 6 minutes on the 2-core box at the defaults: the profile ~25 s, each
configuration ~2 min with its start and warm-up. On a loaded machine the measured side is slower than the
profile says, so predictions come out low: run it on a quiet machine for figures to quote.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and Ray: the workers inherit it
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import RESULTS, console, machine, print_table, save  # noqa: E402
from benchmarks.disaggregation import Spec, drive, warm_up  # noqa: E402
from cluster.planner.measure import MeasureGrid, engine_for, measure  # noqa: E402
from cluster.planner.profile import Profile, load_profile  # noqa: E402
from cluster.planner.simulator import COLOCATED, DISAGGREGATED, SimResult, Topology, percentile, simulate  # noqa: E402
from cluster.planner.workload import RequestSpec  # noqa: E402
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from  # noqa: E402
from cluster.ray_cluster.launcher import Cluster  # noqa: E402

NAME = "planner-validation"
GRID = MeasureGrid(prefill_tokens=(16, 64, 128, 256, 512), prefill_contexts=(0, 256),
                   decode_batches=(1, 2, 4, 8, 16), decode_contexts=(64, 256, 512),
                   transfer_tokens=(16, 256, 1024), repeats=3, decode_steps=8)
CONFIGS = {"colocated-1": Topology(COLOCATED, 0, 1), "colocated-2": Topology(COLOCATED, 0, 2),
           "1P+1D": Topology(DISAGGREGATED, 1, 1)}
FIGURES = ("ttft", "itl", "tpot")


def workload(args: argparse.Namespace) -> tuple[list[Spec], list[RequestSpec]]:
    rng = np.random.default_rng(args.seed)
    arrivals = np.cumsum(rng.exponential(1 / args.rate, args.num_requests)) - 1 / args.rate
    specs, requests = [], []
    for index, at in enumerate(np.maximum(arrivals, 0.0)):
        prompt = rng.integers(1000, 30000, int(rng.integers(64, 257))).tolist()
        output = int(rng.integers(16, 65))
        specs.append(Spec(f"r{index}", "short", float(at), prompt, output))
        requests.append(RequestSpec(float(at), len(prompt), output))
    return specs, requests


def profile_here(args: argparse.Namespace) -> Profile:
    if args.profile:
        return load_profile(args.profile)
    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    profile = measure(engine_for("default", "auto", GRID), GRID)
    profile.save(RESULTS / f"{NAME}.profile.json")
    console.print(f"profile: {time.monotonic() - started:.0f} s -> {RESULTS / f'{NAME}.profile.json'}")
    return profile


def cluster_config(topology: Topology) -> ClusterConfig:
    engine = engine_config_from({"kv_cache_memory_gb": 1.0})
    pool = PoolConfig(replicas=topology.num_decode, num_cpus=1, threads=1)
    if topology.mode == COLOCATED:
        return ClusterConfig(mode=COLOCATED, prefill=PoolConfig(replicas=0), decode=pool, engine=engine)
    return ClusterConfig(mode=DISAGGREGATED, prefill=PoolConfig(replicas=topology.num_prefill, num_cpus=1, threads=1),
                         decode=pool, engine=engine)


def measured_run(name: str, topology: Topology, specs: list[Spec], args: argparse.Namespace) -> dict[str, Any]:
    console.rule(f"[bold]{name}")
    cluster = Cluster(cluster_config(topology)).start()
    try:
        async def run() -> list[Any]:
            await warm_up(cluster, args)
            return await drive(cluster, specs, args, name)

        records = asyncio.run(run())
    finally:
        cluster.stop()
    ok = [r for r in records if r.error is None and r.events]
    return {"ttft": [r.ttft_s for r in ok], "itl": [gap for r in ok for gap in r.gaps_s],
            "tpot": [(r.events[-1][0] - r.events[0][0]) / (r.num_tokens - 1) for r in ok if r.num_tokens > 1],
            "failed": len(records) - len(ok), "errors": sorted({r.error for r in records if r.error})[:5]}


def predicted_run(result: SimResult) -> dict[str, list[float]]:
    return {"ttft": [r.ttft_s for r in result.requests], "itl": [g for r in result.requests for g in r.itls_s],
            "tpot": [r.tpot_s for r in result.requests if len(r.token_times) > 1]}


def compare(measured: dict[str, Any], predicted: dict[str, list[float]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for figure in FIGURES:
        for q in (50, 90):
            real, model = percentile(measured[figure], q), percentile(predicted[figure], q)
            rows[f"{figure}_p{q}"] = {"measured_s": real, "predicted_s": model, "error": model / real - 1}
    return rows


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FIGURES), figsize=(5 * len(FIGURES), 4.5))
    for ax, figure in zip(axes, FIGURES, strict=True):
        points = [(name, q, run["comparison"][f"{figure}_p{q}"]) for name, run in results.items() for q in (50, 90)]
        values = [v for _, _, p in points for v in (p["measured_s"] * 1000, p["predicted_s"] * 1000)]
        low, high = min(values) * 0.7, max(values) * 1.3
        ax.fill_between([low, high], [low * 0.75, high * 0.75], [low * 1.25, high * 1.25], color="0.9", label="±25%")
        ax.plot([low, high], [low, high], color="0.5", lw=1)
        for name, q, p in points:
            ax.scatter(p["measured_s"] * 1000, p["predicted_s"] * 1000, marker="o" if q == 50 else "^",
                       label=f"{name} p{q}")
        ax.set(xscale="log", yscale="log", xlabel="measured ms", ylabel="predicted ms", title=figure.upper())
    axes[0].legend(fontsize=7)
    fig.suptitle("pdserve planner: simulated vs measured (this machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default="", help="reuse this profile instead of measuring one")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--drain", type=float, default=60.0, help="seconds past the last arrival to finish")
    args = parser.parse_args()
    info = machine("benchmarks.planner_validation")
    profile = profile_here(args)
    specs, requests = workload(args)
    args.duration = max(spec.arrival_s for spec in specs)  # `drive` stops waiting at duration + drain
    results: dict[str, Any] = {}
    for name in args.configs:
        measured = measured_run(name, CONFIGS[name], specs, args)
        predicted = predicted_run(simulate(profile, CONFIGS[name], requests))
        results[name] = {"comparison": compare(measured, predicted), "failed": measured["failed"],
                         "errors": measured["errors"], "load_average_after": os.getloadavg()}
    rows = [[name, key, f"{v['measured_s'] * 1000:.0f}", f"{v['predicted_s'] * 1000:.0f}", f"{v['error']:+.0%}"]
            for name, run in results.items() for key, v in run["comparison"].items()]
    print_table("planner validation (ms)", ["config", "figure", "measured", "predicted", "error"], rows)
    save(NAME, {"results": results, "workload": {"rate": args.rate, "num_requests": args.num_requests,
                                                 "seed": args.seed}, "profile": profile.as_dict()}, info)
    plot(results, RESULTS / f"{NAME}.png")


if __name__ == "__main__":
    main()
