"""The planner's simulator against real clusters on the machine it runs on.

    python -m benchmarks.planner_validation [--rate 0.5] [--num-requests 40] [--profile PROFILE.json]

1. Profile: one engine of the default model in this process, one torch thread (each worker below
   gets one: `threads: 1`), on a grid sized to the workload (`GRID`); or `--profile` to reuse one.
2. For each configuration (colocated x1, colocated x2, 1P+1D by default; `--configs`), start the
   real cluster (embedded Ray, UCX between the pools), warm it up, and replay the workload: Poisson
   arrivals at `--rate`, prompts of 64-256 random ids, 16-64 output tokens (greedy, EOS ignored),
   every token event timestamped at the client (`cluster.bench.cluster_runs`). Before the
   workload, a few requests alone time what serving adds to the profile's steps on that cluster
   (`cluster.bench.planner_runs.measure_serving`: the first token's hops, each step's dispatch).
3. Simulate the same requests on the same topology from the profile with those serving latencies
   (and the front door's CPU measured over the run: `cluster.bench.planner_runs`), and compare TTFT,
   ITL and TPOT p50/p90, predicted against measured; and every request's TTFT against its own
   simulated one (`per_request`: where the percentiles hide a queue the model gets wrong).
The helpers shared with `benchmarks.planner_goodput` are in `cluster.bench.planner_runs`.
Results: benchmarks/results/planner-validation.<machine>.<date>.json and .png (predicted against measured,
with the ±25% band). Most of its time goes to each configuration's start and warm-up. On a loaded machine
the measured side is slower than the
profile says, so predictions come out low: run it on a quiet machine for figures to quote.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and Ray: the workers inherit it
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import argparse  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import machine, print_table, result_path, save  # noqa: E402
from cluster.bench.arrivals import ArrivalProcess  # noqa: E402
from cluster.bench.planner_runs import (  # noqa: E402
    FIGURES,
    compare,
    measured_run,
    per_request,
    predicted_run,
    profile_here,
    with_serving,
)
from cluster.bench.workloads import RequestShape, TimedRequest, timed_requests  # noqa: E402
from cluster.planner.front_door import cores_between  # noqa: E402
from cluster.planner.measure import MeasureGrid  # noqa: E402
from cluster.planner.profile import Profile, Serving  # noqa: E402
from cluster.planner.simulator import (  # noqa: E402
    COLOCATED,
    DISAGGREGATED,
    Topology,
    front_door_cores,
    oversubscription,
    simulate,
)
from cluster.planner.workload import RequestSpec  # noqa: E402

NAME = "planner-validation"
nan = float("nan")  # a figure with too few requests to say
GRID = MeasureGrid(prefill_tokens=(16, 64, 128, 256, 512), prefill_contexts=(0, 256),
                   decode_batches=(1, 2, 4, 8, 16), decode_contexts=(64, 256, 512),
                   transfer_tokens=(16, 256, 1024), repeats=3, decode_steps=8, decode_warmup=3)
CONFIGS = {"colocated-1": Topology(COLOCATED, 0, 1), "colocated-2": Topology(COLOCATED, 0, 2),
           "1P+1D": Topology(DISAGGREGATED, 1, 1)}


def workload(args: argparse.Namespace) -> tuple[list[TimedRequest], list[RequestSpec]]:
    """Poisson arrivals, the first one mean gap early (at 0 when its own gap was shorter: the run
    starts busy); prompts of 64-256 tokens, 16-64 output tokens."""
    rng = np.random.default_rng(args.seed)
    arrivals = ArrivalProcess(args.rate).times(rng, args.num_requests, start=-1 / args.rate)
    specs = timed_requests(rng, [max(t, 0.0) for t in arrivals], RequestShape((64, 256), (16, 64)))
    return specs, [RequestSpec(spec.arrival_s, len(spec.prompt), spec.max_tokens) for spec in specs]


def validate(name: str, profile: Profile, specs: list[TimedRequest], requests: list[RequestSpec],
             args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: measured, then simulated with the serving latencies timed on that cluster."""
    topology = CONFIGS[name]
    measured = measured_run(name, topology, specs, args, profile)
    served = with_serving(profile, topology.mode, measured["serving"])
    result = simulate(served, topology, requests)
    front_door = front_door_cores(measured["serving"], requests)
    return {"comparison": compare(measured, predicted_run(result)), "serving": asdict(measured["serving"]),
            "front_door_cores": front_door, "slowdown": oversubscription(served, topology, front_door),
            "front_door_windows": measured["front_door_windows"],
            "per_request": per_request(measured, result, specs),
            "other_cores_mean": cores_between(measured["other_load"], 0.0, float("inf")),
            "failed": measured["failed"], "errors": measured["errors"], "load_average_after": os.getloadavg()}


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
    profile = profile_here(args.profile, GRID, result_path(NAME, ".profile.json"))
    specs, requests = workload(args)
    args.duration = max(spec.arrival_s for spec in specs)  # `drive` stops waiting at duration + drain
    results = {name: validate(name, profile, specs, requests, args) for name in args.configs}
    timed: dict[str, Serving] = {}  # each mode's first cluster's serving latencies, into the profile
    for name, run in results.items():
        timed.setdefault(CONFIGS[name].mode, Serving(**run["serving"]))
    profile = replace(profile, serving={**profile.serving, **timed})
    profile.save(result_path(NAME, ".profile.json"))
    rows = [[name, key, f"{v['measured_s'] * 1000:.0f}", f"{v['predicted_s'] * 1000:.0f}", f"{v['error']:+.0%}"]
            for name, run in results.items() for key, v in run["comparison"].items()]
    print_table("planner validation (ms)", ["config", "figure", "measured", "predicted", "error"], rows)
    print_table("each request's TTFT, simulated against measured",
                ["config", "requests", "median error", "within 25%", "rank correlation", "in quiet spells: n, median, "
                 "within 25%", "step factor", "front door cores", "other processes' cores"],
                [[name, str(agreement["requests"]), f"{agreement.get('median_error', nan):+.0%}",
                  f"{agreement.get('within_25pct', nan):.0%}", f"{agreement.get('rank_correlation', nan):.2f}",
                  f"{agreement['quiet']['requests']}, {agreement['quiet'].get('median_error', nan):+.0%}, "
                  f"{agreement['quiet'].get('within_25pct', nan):.0%}",
                  f"{run['serving']['step_factor']:.2f}", f"{run['front_door_cores']:.2f}",
                  f"{run['other_cores_mean']:.2f}"]
                 for name, run in results.items() for agreement in [run["per_request"]]])
    save(NAME, {"results": results, "workload": {"rate": args.rate, "num_requests": args.num_requests,
                                                 "seed": args.seed}, "profile": profile.as_dict()}, info)
    plot(results, result_path(NAME, ".png"))


if __name__ == "__main__":
    main()
