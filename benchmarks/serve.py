"""Serving sweeps: a server started per setting (`pdserve serve` in a subprocess), driven over HTTP
by `cluster.bench.serving`; results go to benchmarks/results/serve-<sweep>.<machine>.<date>.json/.png.

    python -m benchmarks.serve                      # both sweeps
    python -m benchmarks.serve rate --quick         # a short version of one sweep (files serve-rate-sweep-quick.*)
    python -m benchmarks.serve token-budget --budgets 512 2048
    python -m benchmarks.serve all --cluster        # the disaggregated Ray cluster instead of one engine

- `rate`: one server; synthetic requests at increasing Poisson rates, then all at once. The curve
  is TTFT and ITL (p50, p99) against the output throughput achieved.
- `token-budget`: one server per `max_num_batched_tokens`; a mix of long prompts and short
  streaming requests. Long prefills share steps with decodes: a larger budget finishes a prompt in
  fewer steps (its TTFT) but makes those steps longer (every running stream's ITL).

The server runs its engine with `--threads` torch threads (OMP_NUM_THREADS; 1 by default, see
docs/performance.md on noise), the benchmark client in this process. The default model is
SmolLM2-135M-Instruct from the local cache; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

from benchmarks.common import console, cpu_model, git_state, print_table, result_path, save  # noqa: E402
from cluster.bench.plots import pyplot, save_figure  # noqa: E402
from cluster.bench.server_runs import ServerSettings, measure, running_server  # noqa: E402
from cluster.bench.serving import LoadConfig, finite  # noqa: E402
from cluster.bench.workloads import WorkloadConfig  # noqa: E402

MS = "ms"


# ---- the sweeps ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RatePlan:
    rates: tuple[float, ...]
    seconds_per_rate: float  # requests at a finite rate: rate x this, within [min_requests, max_requests]
    min_requests: int
    max_requests: int
    burst_requests: int  # at the infinite rate
    workload: WorkloadConfig

    def num_requests(self, rate: float) -> int:
        if math.isinf(rate):
            return self.burst_requests
        return min(self.max_requests, max(self.min_requests, round(rate * self.seconds_per_rate)))


RATE_PLAN = RatePlan(rates=(0.25, 0.5, 1.0, 2.0, math.inf), seconds_per_rate=30.0, min_requests=8, max_requests=24,
                     burst_requests=24, workload=WorkloadConfig(input_len=64, output_len=24))
RATE_PLAN_QUICK = RatePlan(rates=(0.5, 2.0, math.inf), seconds_per_rate=12.0, min_requests=6, max_requests=24,
                           burst_requests=12, workload=WorkloadConfig(input_len=32, output_len=12))

# A quarter long prompts (random ids: no prefix to share) among short streaming requests, Poisson arrivals.
BUDGET_WORKLOAD = WorkloadConfig(kind="long-mix", num_requests=12, long_len=1024, long_fraction=0.25, input_len=32,
                                 output_len=24, input_sigma=0.3, output_sigma=0.3)
BUDGET_WORKLOAD_QUICK = replace(BUDGET_WORKLOAD, num_requests=8, long_len=512, output_len=12)
BUDGETS = (512, 2048, 8192, 32768)


def sweep_rate(args: argparse.Namespace, info: dict[str, Any]) -> None:
    plan = RATE_PLAN_QUICK if args.quick else RATE_PLAN
    settings = server_settings(args)
    points = []
    with running_server(settings) as url:
        for index, rate in enumerate(plan.rates):
            workload = replace(plan.workload, num_requests=plan.num_requests(rate), seed=args.seed + index)
            console.print(f"[bold]rate {rate:g}/s[/]: {workload.num_requests} requests")
            points.append({"request_rate": rate, "workload": asdict(workload),
                           **measure(url, workload, LoadConfig(request_rate=rate, seed=args.seed + index))})
    print_table("serving: latency vs load (synthetic requests, ms)",
                ["rate/s", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "failed"],
                [[p["request_rate"], p["request_throughput"], p["output_throughput"], p["ttft_ms"]["p50"],
                  p["ttft_ms"]["p99"], p["itl_ms"]["p50"], p["itl_ms"]["p99"], p["failed"]] for p in points])
    name = result_name("serve-rate-sweep", args)
    save(name, finite({"server": asdict(settings), "plan": asdict(plan), "points": points}), finish(info))
    plot_rate_sweep(points, result_path(name, ".png"))


# The token-budget sweep's headline figures: (name, path in a run's summary).
BUDGET_FIGURES = (("ttft_p95_long", ("by_tag", "long", "ttft_ms", "p95")),
                  ("ttft_p95_short", ("by_tag", "short", "ttft_ms", "p95")),
                  ("itl_p50", ("itl_ms", "p50")), ("itl_p95", ("itl_ms", "p95")), ("itl_p99", ("itl_ms", "p99")),
                  ("e2e_p95", ("e2e_ms", "p95")),
                  ("output_throughput", ("output_throughput",)), ("failed", ("failed",)))


def sweep_token_budget(args: argparse.Namespace, info: dict[str, Any]) -> None:
    """Each budget `--repeats` times, in order then in reverse (ABCD DCBA ...), so that a machine
    getting busier or quieter during the sweep weighs on every setting alike; the figures are the
    means over the repeats (each repeat draws a fresh workload: nothing left in a prefix cache helps)."""
    workload = BUDGET_WORKLOAD_QUICK if args.quick else BUDGET_WORKLOAD
    load = LoadConfig(request_rate=args.budget_rate)
    runs = budget_runs(args, workload, load)
    points = [budget_point(budget, measured) for budget, measured in runs.items()]
    print_table(f"serving: token budget on long prompts among streams (ms; means of {args.repeats} runs)",
                ["budget", *(name for name, _ in BUDGET_FIGURES)],
                [[p["max_num_batched_tokens"], *(p[name] for name, _ in BUDGET_FIGURES)] for p in points])
    name = result_name("serve-token-budget", args)
    data = {"server": asdict(server_settings(args)), "workload": asdict(workload), "load": asdict(load),
            "repeats": args.repeats, "points": points}
    save(name, finite(data), finish(info))
    plot_token_budget(points, result_path(name, ".png"))


def budget_runs(args: argparse.Namespace, workload: WorkloadConfig, load: LoadConfig) -> \
        dict[int, list[dict[str, Any]]]:
    """Every budget's runs. A local engine starts at its budget's first run and then waits, idle, for
    its next turn; a Ray cluster (`--cluster`) starts for each run, one at a time."""
    schedule = [(repeat, budget) for repeat in range(args.repeats)
                for budget in (args.budgets if repeat % 2 == 0 else args.budgets[::-1])]
    runs: dict[int, list[dict[str, Any]]] = {budget: [] for budget in args.budgets}
    with ExitStack() as servers:
        urls: dict[int, str] = {}
        for repeat, budget in schedule:
            settings = replace(server_settings(args), max_num_batched_tokens=budget)
            if args.cluster or budget not in urls:
                urls[budget] = servers.enter_context(running_server(settings))
            console.print(f"[bold]max_num_batched_tokens {budget}[/], run {repeat + 1}: "
                          f"{workload.num_requests} requests")
            seed = args.seed + repeat
            runs[budget].append(measure(urls[budget], replace(workload, seed=seed), replace(load, seed=seed)))
            if args.cluster:
                servers.close()
    return runs


def budget_point(budget: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A budget's headline figures, each the mean over its runs, and the runs themselves."""
    figures = {name: statistics.fmean(figure(run, path) for run in runs) for name, path in BUDGET_FIGURES}
    return {"max_num_batched_tokens": budget, **figures, "runs": runs}


def figure(run: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = run
    for key in path:
        value = value[key]
    return float(value)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(model=args.model, threads=args.threads, cluster=args.cluster)


def result_name(base: str, args: argparse.Namespace) -> str:
    return base + ("-cluster" if args.cluster else "") + ("-quick" if args.quick else "")


def machine_info(argv: Sequence[str]) -> dict[str, Any]:
    """What the numbers were measured on; the load averages tell how busy the machine was."""
    import datetime
    import platform

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "load_average_at_start": os.getloadavg(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["python -m benchmarks.serve", shlex.join(argv)]).strip(), "git": git_state()}


def finish(info: dict[str, Any]) -> dict[str, Any]:
    return {**info, "load_average_at_end": os.getloadavg()}


# ---- plots --------------------------------------------------------------------------------------

def plot_rate_sweep(points: list[dict[str, Any]], path: Path) -> None:
    """TTFT and ITL (p50, p99) against the output throughput achieved: a line through the finite
    rates (each labelled), a star for everything sent at once."""
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    paced = [p for p in points if not math.isinf(p["request_rate"])]
    bursts = [p for p in points if math.isinf(p["request_rate"])]
    for ax, metric, title in ((axes[0], "ttft_ms", "time to first token"), (axes[1], "itl_ms", "inter-token latency")):
        for (percentile, style), color in zip((("p50", "o-"), ("p99", "s--")), ("tab:blue", "tab:orange"), strict=True):
            ax.plot([p["output_throughput"] for p in paced], [p[metric][percentile] for p in paced], style,
                    color=color, label=f"{percentile}, Poisson arrivals")
            ax.plot([p["output_throughput"] for p in bursts], [p[metric][percentile] for p in bursts], "*",
                    markersize=12, color=color, label=f"{percentile}, all at once")
        for p in paced:
            ax.annotate(f"{p['request_rate']:g}/s", (p["output_throughput"], p[metric]["p99"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(xlabel="output tokens/s achieved", ylabel=MS, title=title, yscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def plot_token_budget(points: list[dict[str, Any]], path: Path) -> None:
    """TTFT p95 (long and short prompts) and ITL p50, p95, p99 per max_num_batched_tokens: lines
    through the means, a dot per run. ITL p99 shows the stalls a whole long prefill in one step causes,
    which p95 can miss (they hit one token per stream)."""
    plt = pyplot()
    if plt is None:
        return
    budgets = [p["max_num_batched_tokens"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = ((axes[0], "TTFT p95", (("ttft_p95_long", "long prompts", "o-"), ("ttft_p95_short", "short", "s-"))),
              (axes[1], "inter-token latency", (("itl_p99", "p99", "^:"), ("itl_p95", "p95", "o-"),
                                                 ("itl_p50", "p50", "s--"))))
    paths = dict(BUDGET_FIGURES)
    for ax, title, lines in panels:
        for name, label, style in lines:
            drawn = ax.plot(budgets, [p[name] for p in points], style, label=label)
            runs = [(p["max_num_batched_tokens"], figure(run, paths[name])) for p in points for run in p["runs"]]
            ax.scatter(*zip(*runs, strict=True), s=12, alpha=0.4, color=drawn[0].get_color())
        ax.set(title=title, xlabel="max_num_batched_tokens", ylabel=MS, xscale="log", yscale="log")
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path)


# ---- the command line ---------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", nargs="?", choices=["all", "rate", "token-budget"], default="all")
    parser.add_argument("--quick", action="store_true", help="fewer points and requests (~4 minutes for both sweeps)")
    parser.add_argument("--cluster", action="store_true", help="the Ray cluster (1 prefill + 1 decode worker)")
    parser.add_argument("--model", default="default", help="'default', a checkpoint directory or a .gguf file")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS), help="token-budget: settings")
    parser.add_argument("--budget-rate", type=float, default=0.5, help="token-budget: requests per second")
    parser.add_argument("--repeats", type=int, default=2, help="token-budget: runs per budget, in alternating order")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    info = machine_info(argv)
    started = time.monotonic()
    if args.sweep in ("all", "rate"):
        sweep_rate(args, info)
    if args.sweep in ("all", "token-budget"):
        sweep_token_budget(args, info)
    console.print(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
