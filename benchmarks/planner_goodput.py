"""Does the plan win: the planned configuration's MEASURED goodput against 1P+1D and colocated.

    python -m benchmarks.planner_goodput [--profile PROFILE.json] [--rate 0.9] [--num-requests 40]
        [--slo-ttft 1.5] [--slo-tpot 0.1]

1. Profile: one engine of the default model in this process, one torch thread (`GRID`, prompts to 1,024
   tokens), or `--profile` to reuse one.
2. The defaults, each a real cluster on the same requests (one core and one thread per worker,
   the engine's default limits: 2,048 tokens a step, 256 sequences): 1P+1D, colocated x1 and x2.
   Each cluster first times what serving adds to the steps (`cluster.bench.planner_runs.measure_serving`); the
   first of each mode goes into the profile (saved as `planner-goodput.<machine>.<date>.profile.json`).
3. `plan` with budget 2 on that profile, the workload and the SLOs (the search `pdserve plan`
   runs). It sees the profile and the serving latencies, never the measured runs' figures.
4. The planned configuration on a real cluster, unless it IS one of the defaults (then said so
   plainly, and its margin is against the others).
5. Per arm, measured against predicted: goodput (requests meeting both SLOs per second, first
   arrival to last token), goodput per worker, attainment, TTFT and TPOT p50/p90.
Results: benchmarks/results/planner-goodput.<machine>.<date>.json and .png.

The workload (why this one): Poisson arrivals at 0.9/s of long prompts (512-1,024 tokens, around a
second of prefill each on one CPU thread) and short answers (16-48 tokens), under a TTFT SLO of
1.5 s and a loose TPOT SLO of 100 ms: a TTFT SLO that 1P+1D cannot hold, as its one prefill worker
takes every prompt (most of its time goes to prompts, so they queue), while two colocated workers
share them. `--explore` simulates the plan and the defaults over a few workloads and stops: with
short prompts (64-256) or light load every shape meets the SLOs and the goodputs tie (the arrival
rate); with TPOT SLOs tight enough to hurt colocated decodes, the simulated differences are within
a few percent on two cores (a prompt interrupts only its own worker's decodes), too close to
measure; this workload separates the shapes. The plan may pick one of the defaults (colocated x2 at
the engine's default limits, on a CPU profile): its margin is then against the others. Each run
plans afresh from its own profile and says which it chose; docs/performance.md has the figures.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and Ray: the workers inherit it
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import argparse  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import console, machine, print_table, result_path, save  # noqa: E402
from cluster.bench.planner_runs import measured_run, profile_here, specs_for, with_serving  # noqa: E402
from cluster.planner.measure import MeasureGrid  # noqa: E402
from cluster.planner.plan import SearchSpace, Slo, plan  # noqa: E402
from cluster.planner.profile import Profile  # noqa: E402
from cluster.planner.simulator import COLOCATED, DISAGGREGATED, SimResult, Topology, percentile, simulate  # noqa: E402
from cluster.planner.workload import RequestSpec, workload_from_dict  # noqa: E402

NAME = "planner-goodput"
GRID = MeasureGrid(prefill_tokens=(16, 64, 256, 512, 1024), prefill_contexts=(0, 512),
                   decode_batches=(1, 2, 4, 8, 16), decode_contexts=(64, 512, 1024),
                   transfer_tokens=(16, 256, 1024), repeats=3, decode_steps=8, decode_warmup=3)
DEFAULTS = {"1P+1D": Topology(DISAGGREGATED, 1, 1), "colocated-1": Topology(COLOCATED, 0, 1),
            "colocated-2": Topology(COLOCATED, 0, 2)}
BUDGET = 2


def workload(rate: float, num_requests: int, seed: int, prompt: tuple[int, int],
             output: tuple[int, int]) -> list[RequestSpec]:
    return workload_from_dict({"arrival": "poisson", "rate": rate, "num_requests": num_requests, "seed": seed,
                               "prompt": {"kind": "uniform", "low": prompt[0], "high": prompt[1]},
                               "output": {"kind": "uniform", "low": output[0], "high": output[1]}})


def figures(ttfts: list[float], tpots: list[float], met: int, total: int, duration_s: float,
            workers: int) -> dict[str, float]:
    goodput = met / duration_s
    return {"goodput_rps": goodput, "goodput_per_worker_rps": goodput / workers, "attainment": met / total,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "tpot_p50_s": percentile(tpots, 50), "tpot_p90_s": percentile(tpots, 90), "duration_s": duration_s}


def predicted(result: SimResult, slo: Slo) -> dict[str, float]:
    met = sum(result.meets(r, slo.ttft_s, slo.tpot_s) for r in result.requests)
    return figures([r.ttft_s for r in result.requests], [r.tpot_s for r in result.requests], met,
                   len(result.requests), result.duration_s, result.topology.num_workers)


def measured(run: dict[str, Any], slo: Slo, total: int, workers: int) -> dict[str, float]:
    """Requests that failed or never finished count as missing the SLO; the run lasts from the first
    request sent to the last token."""
    requests = run["requests"]
    met = sum(r["ttft_s"] <= slo.ttft_s and r["tpot_s"] <= slo.tpot_s for r in requests)
    duration = max(r["finished_s"] or 0.0 for r in requests) - min(r["sent_s"] for r in requests)
    return figures([r["ttft_s"] for r in requests], [r["tpot_s"] for r in requests], met, total, duration, workers)


def explore(profile: Profile, slo: Slo) -> None:
    """The simulator's view of a few workloads: where the plan's choice matters on two cores."""
    rows = []
    for rate, prompt, output in ((0.9, (512, 1024), (16, 48)), (0.45, (640, 1024), (48, 96)),
                                 (0.3, (768, 1024), (64, 128)), (1.0, (64, 256), (32, 64))):
        requests = workload(rate, 40, 0, prompt, output)
        best = plan(profile, requests, slo, SearchSpace(budget=BUDGET)).best
        row = [f"{rate}/s {prompt} {output}", f"{best.topology.describe()} {best.topology.decode_limits}",
               f"{best.goodput:.3f}"]
        for topology in DEFAULTS.values():
            result = simulate(profile, topology, requests)
            goodput, attainment = result.goodput(slo.ttft_s, slo.tpot_s), result.attainment(slo.ttft_s, slo.tpot_s)
            row.append(f"{goodput:.3f} ({attainment:.0%})")
        rows.append(row)
    print_table(f"simulated goodput (req/s), SLO TTFT {slo.ttft_s} s, TPOT {slo.tpot_s * 1000:.0f} ms",
                ["workload", "plan", "plan goodput", *DEFAULTS], rows)


def plot(arms: dict[str, Any], slo: Slo, planned_name: str, load: tuple[float, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(arms)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, label) in zip(axes, (("goodput_rps", "goodput (req/s)"), ("ttft_p90_s", "TTFT p90 (s)"),
                                        ("tpot_p90_s", "TPOT p90 (s)")), strict=True):
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [arms[n]["measured"][key] for n in names], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [arms[n]["predicted"][key] for n in names], 0.4, label="predicted")
        ax.set_xticks(list(xs), [n + (" (planned)" if n == planned_name else "") for n in names], rotation=15,
                      fontsize=8)
        ax.set_title(label)
        if key != "goodput_rps":
            ax.axhline(slo.ttft_s if key.startswith("ttft") else slo.tpot_s, color="0.4", ls="--", lw=1)
    axes[0].legend(fontsize=8)
    fig.suptitle("pdserve planner: planned vs default configurations on this machine (load average after: "
                 + ", ".join(f"{value:.1f}" for value in load) + ")")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(arms: dict[str, Any], planned_name: str, default_name: str | None, meets_slo: bool) -> list[str]:
    lines = []
    if not meets_slo:
        lines.append("No configuration of the budget meets the SLO attainment in the simulation: the plan is the "
                     "best attainment, not a goodput optimum (a slower profile, or too much load for 2 workers).")
    if default_name is not None:
        lines.append(f"The plan's choice IS the default {default_name}: its margin is against the other defaults.")
    mine = arms[planned_name]["measured"]["goodput_rps"]
    for name, arm in arms.items():
        if name == planned_name:
            continue
        other = arm["measured"]["goodput_rps"]
        margin = f"{mine / other - 1:+.0%}" if other > 0 else "(the other met no SLO)"
        lines.append(f"planned {planned_name}: {mine:.3f} req/s measured vs {name} {other:.3f}: {margin}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="", help="reuse this profile instead of measuring one")
    parser.add_argument("--rate", type=float, default=0.9, help="requests per second (Poisson)")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--prompt", type=int, nargs=2, default=(512, 1024), help="prompt tokens, low high")
    parser.add_argument("--output", type=int, nargs=2, default=(16, 48), help="output tokens, low high")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=1.5, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    parser.add_argument("--drain", type=float, default=60.0, help="seconds past the last arrival to finish")
    parser.add_argument("--explore", action="store_true", help="print the simulator's view of a few workloads")
    args = parser.parse_args()
    info = machine("benchmarks.planner_goodput")
    slo = Slo(args.slo_ttft, args.slo_tpot)
    profile = profile_here(args.profile, GRID, result_path(NAME, ".profile.json"))
    if args.explore:
        explore(profile, slo)
        return
    requests = workload(args.rate, args.num_requests, args.seed, tuple(args.prompt), tuple(args.output))
    specs = specs_for(requests, args.seed)
    args.duration = max(spec.arrival_s for spec in specs)  # `drive` stops waiting at duration + drain
    runs: dict[str, tuple[Topology, dict[str, Any]]] = {}
    for name, topology in DEFAULTS.items():
        runs[name] = topology, measured_run(name, topology, specs, args, profile)
        if topology.mode not in profile.serving:
            profile = with_serving(profile, topology.mode, runs[name][1]["serving"])
    profile.save(result_path(NAME, ".profile.json"))
    planned = plan(profile, requests, slo, SearchSpace(budget=BUDGET))
    chosen = planned.best.topology
    default_name = next((name for name, topology in DEFAULTS.items() if topology == chosen), None)
    planned_name = default_name or f"planned {chosen.describe()}"
    if default_name is None:
        runs[planned_name] = chosen, measured_run(planned_name, chosen, specs, args, profile)
    arms = {name: {"topology": asdict(topology), "serving": asdict(run["serving"]), "failed": run["failed"],
                   "errors": run["errors"], "measured": measured(run, slo, len(requests), topology.num_workers),
                   "predicted": predicted(simulate(profile, topology, requests), slo)}
            for name, (topology, run) in runs.items()}
    rows = [[name + (" (planned)" if name == planned_name else ""), *(
        f"{arm['measured'][key] * scale:.{digits}f} / {arm['predicted'][key] * scale:.{digits}f}"
        for key, scale, digits in (("goodput_rps", 1, 3), ("goodput_per_worker_rps", 1, 3), ("attainment", 100, 0),
                                   ("ttft_p50_s", 1000, 0), ("ttft_p90_s", 1000, 0), ("tpot_p50_s", 1000, 0),
                                   ("tpot_p90_s", 1000, 0)))] for name, arm in arms.items()]
    print_table(f"measured / predicted: SLO TTFT {slo.ttft_s} s, TPOT {slo.tpot_s * 1000:.0f} ms",
                ["arm", "goodput", "per worker", "attain %", "TTFT p50 ms", "TTFT p90", "TPOT p50 ms", "TPOT p90"],
                rows)
    lines = verdict(arms, planned_name, default_name, planned.meets_slo)
    load = os.getloadavg()
    for line in lines:
        console.print(line)
    save(NAME, {"arms": arms, "planned": planned_name, "planned_is_default": default_name is not None,
                "verdict": lines, "slo": asdict(slo), "workload": {
                    "rate": args.rate, "num_requests": args.num_requests, "prompt": args.prompt,
                    "output": args.output, "seed": args.seed}, "load_average_after": load,
                "profile": profile.as_dict()}, info)
    plot(arms, slo, planned_name, load, result_path(NAME, ".png"))


if __name__ == "__main__":
    main()
