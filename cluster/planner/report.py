"""`pdserve plan`: its arguments, the search with a progress bar, and the table of the choice."""

from __future__ import annotations

import argparse
import re

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cluster.planner.cluster_file import helm_flags, write_cluster_file
from cluster.planner.plan import Candidate, Plan, SearchSpace, Slo, count_topologies, plan
from cluster.planner.profile import load_profile
from cluster.planner.simulator import COLOCATED, DISAGGREGATED
from cluster.planner.workload import load_workload

UNITS = {"ms": 1e-3, "s": 1.0, "": 1.0}


def duration(text: str) -> float:
    """An argparse type: "2s", "200ms" or plain seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|)\s*", text)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"a duration like 2s or 200ms, got {text!r}")
    return float(match.group(1)) * UNITS[match.group(2)]


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="a profile from `pdserve profile`")
    parser.add_argument("--workload", required=True, help="workload JSON (cluster/planner/workload.py; a spec or a "
                        "trace)")
    parser.add_argument("--slo-ttft", type=duration, required=True, help="time to first token, e.g. 2s")
    parser.add_argument("--slo-tpot", type=duration, required=True, help="time per output token, e.g. 200ms")
    parser.add_argument("--budget", type=int, required=True, help="most workers to use")
    parser.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    parser.add_argument("--token-budgets", type=int_list, default=(256, 512, 1024, 2048),
                        help="max_num_batched_tokens values to try")
    parser.add_argument("--max-num-seqs", type=int_list, default=(16, 64, 256), help="max_num_seqs values to try")
    parser.add_argument("--mode", choices=["both", COLOCATED, DISAGGREGATED], default="both")
    parser.add_argument("--per-pool", action="store_true", help="search each pool's limits apart (written "
                        "as each pool's own engine: section)")
    parser.add_argument("--write", default="", metavar="CLUSTER_YAML", help="write the choice as a cluster config")
    parser.add_argument("--model", default="default", help="the model written into --write's engine section")


def run_plan(args: argparse.Namespace, console: Console) -> int:
    profile = load_profile(args.profile)
    specs = load_workload(args.workload)
    slo = Slo(args.slo_ttft, args.slo_tpot, args.attainment)
    modes = (COLOCATED, DISAGGREGATED) if args.mode == "both" else (args.mode,)
    space = SearchSpace(args.budget, args.token_budgets, args.max_num_seqs, modes, args.per_pool)
    with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("plan", total=count_topologies(space))
        result = plan(profile, specs, slo, space, on_candidate=lambda: bar.advance(task))
    for note in profile.beyond(max(spec.prompt_tokens for spec in specs),
                               max(spec.prompt_tokens + spec.output_tokens for spec in specs)):
        console.print(f"[yellow]the workload has {note}: extrapolated (profile a larger grid)[/]")
    unmeasured = [mode for mode in modes if mode not in profile.serving]
    if unmeasured:
        console.print(f"[yellow]the profile has no serving latencies for {' and '.join(unmeasured)}: TTFTs leave "
                      "out the hops (benchmarks.planner_validation records them; docs/planner.md)[/]")
    console.print(plan_table(result, len(specs)))
    if not result.meets_slo:
        console.print(f"[red]no configuration within {args.budget} workers meets the SLOs for "
                      f"{slo.attainment:.0%} of requests[/]: the best attainment is shown; raise --budget")
    console.print("helm: " + " ".join(helm_flags(result.best.topology)))
    if args.write:
        write_cluster_file(args.write, result.best.topology, args.model, profile.dtype or "auto",
                           comment=f"pdserve plan: {describe(result.best)}")
        console.print(f"wrote {args.write} (pdserve serve --config {args.write})")
    return 0


def describe(candidate: Candidate) -> str:
    topology = candidate.topology
    limits = (f"tokens {topology.prefill_limits.max_num_batched_tokens}/{topology.decode_limits.max_num_batched_tokens}"
              f", seqs {topology.prefill_limits.max_num_seqs}/{topology.decode_limits.max_num_seqs}"
              if topology.prefill_limits != topology.decode_limits else
              f"tokens {topology.decode_limits.max_num_batched_tokens}, seqs {topology.decode_limits.max_num_seqs}")
    return f"{topology.describe()} ({limits})"


def plan_table(result: Plan, num_requests: int) -> Table:
    table = Table(title=f"pdserve plan: {num_requests} requests, SLO TTFT {result.slo.ttft_s * 1000:g} ms, "
                  f"TPOT {result.slo.tpot_s * 1000:g} ms, attainment {result.slo.attainment:.0%}")
    for column in ("", "configuration", "workers", "goodput/s", "per worker", "attained", "TTFT p50/p90 ms",
                   "TPOT p50/p90 ms", "ITL p50/p90 ms"):
        table.add_column(column, justify="left" if column in ("", "configuration") else "right")
    rows = [("choice", result.best)] + ([("runner-up", result.runner_up)] if result.runner_up else [])
    for label, candidate in rows:
        figures = candidate.result.summary()
        table.add_row(label, describe(candidate), str(candidate.topology.num_workers), f"{candidate.goodput:.3f}",
                      f"{candidate.goodput_per_worker:.3f}", f"{candidate.attainment:.0%}",
                      *(f"{figures[f'{name}_p50_s'] * 1000:.0f}/{figures[f'{name}_p90_s'] * 1000:.0f}"
                        for name in ("ttft", "tpot", "itl")))
    return table
