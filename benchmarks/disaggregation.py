"""Colocated versus disaggregated serving under a mixed workload, measured at the client.

    python -m benchmarks.disaggregation [--duration 90] [--short-rate 0.25] [--long-interval 25]

Two arms with the same number of worker processes (2), one after the other in the same process:
- colocated: 2 colocated workers, each runs prefill and decode of the requests routed to it;
- disaggregated: 1 prefill worker + 1 decode worker, KV sent over UCX (`cluster.transfer.ucx`).

Workload (the same schedule in both arms, drawn from `--seed`):
- short chat requests: prompts of 32-64 random ids in [1000, 30000), 64 output tokens, greedy,
  EOS ignored, Poisson arrivals at `--short-rate` per second for `--duration` seconds;
- long requests: prompts of 1024-1500 tokens, 8 output tokens, one every `--long-interval` seconds
  (first at half an interval), arriving while the short ones run.

The client timestamps every `TokenEvent` as it arrives (`time.perf_counter`). Per short request:
TTFT (arrival to the first event with tokens), inter-token latency (every gap between consecutive
events that carry tokens; the first gap in the disaggregated arm includes the KV transfer and the
decode worker's admission). Per long request: TTFT. Throughput: all output tokens over the time from
the first arrival to the last finish. Arrivals stop at `--duration`; requests not finished
`--drain` seconds later are cancelled and counted as unfinished (a hang shows up there).

Every worker is a Ray actor process; OMP_NUM_THREADS=1 is set before Ray starts (workers inherit
it), so each worker computes on one thread: 2 workers on 2 cores, see docs/performance.md on why
one thread. Results go to benchmarks/results/disaggregation.<machine>.<date>.json and .png (`--name`
changes the first part; `--arms disaggregated colocated` runs the arms in the other order, as a check
that the machine's load, which drifts during a run, is not what separates them).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and Ray: the workers inherit it
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import RESULTS, console, cpu_model, git_state, print_table, result_path  # noqa: E402
from cluster.bench.arrivals import ArrivalProcess  # noqa: E402
from cluster.bench.cluster_runs import Record, drive, warm_up  # noqa: E402
from cluster.bench.workloads import RequestShape, TimedRequest, timed_requests  # noqa: E402
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from  # noqa: E402
from cluster.ray_cluster.launcher import Cluster, init_ray  # noqa: E402

NAME = "disaggregation"
ARMS = ("colocated", "disaggregated")


def schedule(args: argparse.Namespace) -> list[TimedRequest]:
    """The short requests' Poisson arrivals and prompts, then the long requests' (the first at half an interval)."""
    rng = np.random.default_rng(args.seed)
    short = timed_requests(rng, ArrivalProcess(args.short_rate).times_until(rng, args.duration),
                           RequestShape(tuple(args.short_prompt), (args.short_tokens,) * 2, "short"), "short-")
    longs = ArrivalProcess(1 / args.long_interval, "fixed").times_until(rng, args.duration, -args.long_interval / 2)
    long_ = timed_requests(rng, longs, RequestShape(tuple(args.long_prompt), (args.long_tokens,) * 2, "long"), "long-")
    return sorted(short + long_, key=lambda r: r.arrival_s)


def cluster_config(mode: str, args: argparse.Namespace) -> ClusterConfig:
    engine = engine_config_from({"kv_cache_memory_gb": args.kv_cache_gb,
                                 "max_num_batched_tokens": args.max_batched_tokens})
    if mode == "colocated":
        return ClusterConfig(mode="colocated", prefill=PoolConfig(replicas=0),
                             decode=PoolConfig(replicas=2, num_cpus=args.num_cpus), engine=engine)
    return ClusterConfig(mode="disaggregated", prefill=PoolConfig(replicas=1, num_cpus=args.num_cpus),
                         decode=PoolConfig(replicas=1, num_cpus=args.num_cpus), engine=engine)


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[Record]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    short = [r for r in ok if r.kind == "short"]
    long_ = [r for r in ok if r.kind == "long"]
    itl = [g for r in short for g in r.gaps_s]
    first_gap = [r.gaps_s[0] for r in short if r.gaps_s]
    later_gaps = [g for r in short for g in r.gaps_s[1:]]
    short_ttft = [r.ttft_s for r in short if r.ttft_s is not None]
    long_ttft = [r.ttft_s for r in long_ if r.ttft_s is not None]
    tpot = [(r.events[-1][0] - r.events[0][0]) / (r.num_tokens - 1) for r in short if r.num_tokens > 1]
    tokens = sum(r.num_tokens for r in records)
    first = min((r.sent_s for r in records if r.sent_s), default=0.0)
    last = max((r.finished_s for r in records if r.finished_s is not None), default=first)
    span = last - first
    events = sum(len(r.events) for r in short)
    return {
        "requests": {"short": sum(r.kind == "short" for r in records), "long": sum(r.kind == "long" for r in records),
                     "failed_or_unfinished": len(records) - len(ok)},
        "errors": {r.request_id: r.error for r in records if r.error},
        "short_ttft_s": {"p50": pct(short_ttft, 50), "p99": pct(short_ttft, 99), "max": max(short_ttft, default=None)},
        "short_itl_s": {"p50": pct(itl, 50), "p99": pct(itl, 99), "max": max(itl, default=None), "gaps": len(itl)},
        "short_itl_first_gap_s": {"p50": pct(first_gap, 50), "p99": pct(first_gap, 99)},
        "short_itl_later_gaps_s": {"p50": pct(later_gaps, 50), "p99": pct(later_gaps, 99)},
        "short_tpot_s": {"p50": pct(tpot, 50), "p99": pct(tpot, 99)},
        "short_tokens_per_event": (sum(r.num_tokens for r in short) / events) if events else None,
        "long_ttft_s": {"p50": pct(long_ttft, 50), "max": max(long_ttft, default=None), "all": long_ttft},
        "output_tokens": tokens,
        "span_s": span,
        "tokens_per_second": tokens / span if span > 0 else 0.0,
    }


def worker_threads() -> int:
    """torch's intra-op threads in a fresh Ray worker process (the actors' environment)."""
    import ray

    @ray.remote(num_cpus=0)
    def threads() -> tuple[int, str | None]:
        import torch

        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")

    return ray.get(threads.remote(), timeout=120)


def run_arm(mode: str, specs: list[TimedRequest], args: argparse.Namespace) -> dict[str, Any]:
    import ray

    console.rule(f"[bold]{mode}")
    began = time.perf_counter()
    cluster = Cluster(cluster_config(mode, args)).start()
    started_s = time.perf_counter() - began
    load_before = os.getloadavg()
    try:
        async def both() -> list[Record]:
            await warm_up(cluster)
            return await drive(cluster, specs, mode, args.duration + args.drain)

        records = asyncio.run(both())
        router_stats = ray.get(cluster.router.stats.remote(), timeout=30)
        transfers = [asdict(t) for w in cluster.prefill for t in ray.get(w.transfers.remote(), timeout=30)]
        pools = ray.get([w.pool_state.remote() for w in cluster.prefill + cluster.decode], timeout=30)
    finally:
        cluster.stop()
    summary = summarize(records)
    measured = [t for t in transfers if t["request_id"].startswith(f"{mode}-")]  # not the warm-up
    summary.update({
        "mode": mode, "start_s": started_s, "load_average_before": load_before,
        "load_average_after": os.getloadavg(), "router": router_stats,
        "pools_whole_after": all(free == total for free, total in pools), "pools": pools,
        "transfers": {"count": len(measured),
                      "seconds_p50": pct([t["seconds"] for t in measured], 50),
                      "seconds_max": max((t["seconds"] for t in measured), default=None),
                      "mb_total": sum(t["nbytes"] for t in measured) / 1e6,
                      "long": [t for t in measured if "-long-" in t["request_id"]]},
        "workers_used": {kind: sorted({w for r in records if r.kind == kind for w in r.worker_ids})
                         for kind in ("short", "long")},
        "records": [{"id": r.request_id, "kind": r.kind, "prompt_len": r.prompt_len, "sent_s": r.sent_s,
                     "events": r.events, "finished_s": r.finished_s, "workers": r.worker_ids, "error": r.error}
                    for r in records],
    })
    return summary


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(results: dict[str, dict[str, Any]]) -> None:
    rows = []
    for mode, s in results.items():
        rows.append([mode, f"{s['requests']['short']}+{s['requests']['long']}", s["requests"]["failed_or_unfinished"],
                     ms(s["short_ttft_s"]["p50"]), ms(s["short_ttft_s"]["p99"]),
                     ms(s["short_itl_s"]["p50"]), ms(s["short_itl_s"]["p99"]), ms(s["short_itl_s"]["max"]),
                     ms(s["short_itl_first_gap_s"]["p50"]), ms(s["short_itl_first_gap_s"]["p99"]),
                     ms(s["short_itl_later_gaps_s"]["p50"]), ms(s["short_itl_later_gaps_s"]["p99"]),
                     ms(s["long_ttft_s"]["p50"]), ms(s["long_ttft_s"]["max"]), f"{s['tokens_per_second']:.1f}"])
    print_table("Colocated vs disaggregated, 2 workers each (times in ms, measured at the client)",
                ["arm", "short+long", "failed", "short TTFT p50", "p99", "short ITL p50", "p99", "max",
                 "1st gap p50", "p99", "later gaps p50", "p99", "long TTFT p50", "max", "tok/s"], rows)


def _timeline(ax: Any, mode: str, s: dict[str, Any], color: str) -> None:
    """Every gap of every short request at the time it ended; gray spans: long prompts in prefill."""
    xs, ys = [], []
    for r in s["records"]:
        if r["kind"] == "short":
            for a, b in zip(r["events"], r["events"][1:], strict=False):
                xs.append(b[0])
                ys.append((b[0] - a[0]) * 1000)
    ax.scatter(xs, ys, s=3, color=color, alpha=0.5)
    for r in s["records"]:
        if r["kind"] == "long":
            ax.axvspan(r["sent_s"], r["events"][0][0] if r["events"] else r["sent_s"], color="gray", alpha=0.25)
    ax.set(yscale="log", xlabel="seconds since the arm's start", ylabel="ITL (ms, log)",
           title=f"{mode}: each short-request gap over time; gray = a long prompt waiting for its 1st token")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)


def plot(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    try:
        import matplotlib
    except ImportError:
        console.print("[yellow]matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"colocated": "tab:red", "disaggregated": "tab:blue"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (itl_ax, ttft_ax), (tl0, tl1) = axes
    for mode, s in results.items():
        short = [r for r in s["records"] if r["kind"] == "short" and r["error"] is None]
        gaps = sorted(b[0] - a[0] for r in short for a, b in zip(r["events"], r["events"][1:], strict=False))
        if gaps:
            itl_ax.plot(np.array(gaps) * 1000, np.arange(1, len(gaps) + 1) / len(gaps), color=colors[mode],
                        label=f"{mode}: p50 {ms(s['short_itl_s']['p50'])}, p99 {ms(s['short_itl_s']['p99'])} ms")
        ttfts = sorted(r["events"][0][0] - r["sent_s"] for r in short if r["events"])
        if ttfts:
            ttft_ax.plot(np.array(ttfts) * 1000, np.arange(1, len(ttfts) + 1) / len(ttfts), color=colors[mode],
                         label=f"{mode} short: p50 {ms(s['short_ttft_s']['p50'])} ms")
        for value in s["long_ttft_s"]["all"]:
            ttft_ax.axvline(value * 1000, color=colors[mode], linestyle=":", alpha=0.7)
    itl_ax.set(xscale="log", xlabel="inter-token gap of short requests (ms, log)", ylabel="fraction of gaps",
               title="Short requests: inter-token latency (CDF)")
    ttft_ax.set(xscale="log", xlabel="TTFT (ms, log); dotted: each long request", ylabel="fraction of short requests",
                title="Time to first token (CDF)")
    for ax in (itl_ax, ttft_ax):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    for ax, (mode, s) in zip((tl0, tl1), results.items(), strict=False):
        _timeline(ax, mode, s, colors[mode])
    fig.suptitle(f"2 workers, 2 cores: short {args.short_rate}/s x {args.short_tokens} tokens, "
                 f"long {args.long_prompt[0]}-{args.long_prompt[1]}-token prompts every {args.long_interval:g} s")
    fig.tight_layout()
    path = result_path(args.name, ".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"[green]wrote {path.relative_to(RESULTS.parent.parent)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per arm")
    parser.add_argument("--drain", type=float, default=90.0, help="seconds after the last arrival before giving up")
    parser.add_argument("--short-rate", type=float, default=0.25, help="short requests per second (Poisson)")
    parser.add_argument("--short-prompt", type=int, nargs=2, default=(32, 64))
    parser.add_argument("--short-tokens", type=int, default=64)
    parser.add_argument("--long-interval", type=float, default=25.0, help="seconds between long requests")
    parser.add_argument("--long-prompt", type=int, nargs=2, default=(1024, 1500))
    parser.add_argument("--long-tokens", type=int, default=8)
    parser.add_argument("--max-batched-tokens", type=int, default=2048, help="engine token budget per step")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--num-cpus", type=float, default=0.25, help="Ray CPUs per worker actor")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true", help="print only (for trial runs)")
    parser.add_argument("--name", default=NAME, help="the result files' first part (the machine and the date follow)")
    args = parser.parse_args()

    specs = schedule(args)
    init_ray()
    threads, omp = worker_threads()
    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "worker_torch_threads": threads, "worker_OMP_NUM_THREADS": omp,
            "load_average_at_start": os.getloadavg(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": "python -m benchmarks.disaggregation " + shlex.join(sys.argv[1:]), "git": git_state()}
    console.print(f"{len(specs)} requests per arm ({sum(s.kind == 'long' for s in specs)} long); "
                  f"worker torch threads {threads} (OMP_NUM_THREADS={omp})")
    results = {mode: run_arm(mode, specs, args) for mode in args.arms}
    table(results)
    for mode, s in results.items():
        if s["errors"]:
            console.print(f"[red]{mode}: {len(s['errors'])} failed or unfinished: {s['errors']}")
        console.print(f"{mode}: router {s['router']}, pools whole after: {s['pools_whole_after']}, "
                      f"transfers {s['transfers']['count']} (p50 {ms(s['transfers']['seconds_p50'])} ms, "
                      f"max {ms(s['transfers']['seconds_max'])} ms, {s['transfers']['mb_total']:.0f} MB), "
                      f"tokens/event {s['short_tokens_per_event']}, workers {s['workers_used']}")
    if args.no_save:
        return
    data = {"benchmark": NAME, "machine": info,
            "workload": {k: v for k, v in vars(args).items() if k not in ("arms", "no_save", "name")},
            "arm_order": list(args.arms),
            "arms": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(args.name)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")
    console.print(f"[green]wrote {path.relative_to(RESULTS.parent.parent)}")
    plot(results, args)


if __name__ == "__main__":
    main()
