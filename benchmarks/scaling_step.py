"""The live controller through a load step: fixed pools against `scaling:` on.

    python -m benchmarks.scaling_step [--low-load 0.3] [--high-load 1.3] [--phases 20 60 40] [--warm-spares 1]

Both arms start as 1 prefill + 1 decode worker of the default model, one torch thread each, decode
batches capped at `--max-num-seqs` (2) running requests per worker (`decode: {engine: {max_num_seqs}}`).
First, one decode worker's capacity is measured (requests per second with its slots full, after the
warm-up): the same Poisson arrivals then drive both arms at `--low-load` (0.3) times it, then at
`--high-load` (1.3) times it (the step), then at the low load again (or `--low-rate`/`--high-rate`
fixed; the rates follow the machine, so a quiet or a busy one both see a step one worker cannot
hold and two can: at 1.3x, seed 0's busiest 10 s of the step bring 1.8x, under two workers'
2x; at 1.5x they bring 2.0-2.3x, which two workers cannot hold either); prompts of 64-192 random
ids, `--output-tokens` (32) greedy tokens, EOS ignored.
- `fixed`: the pools never change;
- `scaling`: the controller may grow the decode pool to `--max-decode` (2) workers when requests
  wait for a decode slot (queue depth per worker over `--queue-depth` 0.5, i.e. any request waiting
  on one worker, for `--sustain` 2 s) and shrink it when the pool idles for `--scale-down-sustain`
  (5 s: inside the step two workers' slots stay busy, so the pool is never idle there); with
  `--warm-spares` (1) the second worker is started with the arm, unrouted, so growing routes to it
  at once (0: it starts when the decision is made, its model loading then).
Admission limits are off in both arms (`max_*_wait_s: 0`): a request past what the pool holds
waits rather than being refused, so every request ends in its tokens and the step shows as latency.

Measured at the client, per `--window` (10 s) of arrival time: TTFT and TPOT (seconds per output
token after the first) p50/p90, and SLO attainment (TTFT <= `--slo-ttft`, TPOT <= `--slo-tpot`);
the decode pool's size sampled every 0.5 s and every decision of the controller, with the times of
its steps from the arm's start (`phases`: the signal passing its target, the decision, the actor
made, its model loaded, warmed up, routed to, and the first request the new worker streamed: when it
was sent and when its first token from that worker came). Every request is accounted for: its
tokens counted, each event's index checked, errors listed.

Why more workers help on a 2-core machine: a decode worker here is bound by its running slots
(`max_num_seqs` 2, standing for a worker whose KV cache or batch limit is full), not by its core:
at batch 2 a step of this model costs little more than at batch 1, so a second worker on the
second core adds slots and cores the first could not use. It shows the controller's loop (signal,
decision, warm-up, routing, drain) closing under a step and the SLO recovering; it does not show
CPU-bound scaling (with every core busy, a worker more adds nothing) nor node provisioning.
Results: benchmarks/results/scaling-step.<machine>.<date>.json and .png (the fixed arm's queue drains after
the step, which lengthens its run); docs/deploy.md has the figures.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and Ray: the workers inherit it
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import console, machine, print_table, result_path, save  # noqa: E402
from cluster.bench.arrivals import ArrivalProcess  # noqa: E402
from cluster.bench.cluster_runs import Record, send, settle, warm_up  # noqa: E402
from cluster.bench.workloads import RequestShape, TimedRequest, timed_requests  # noqa: E402
from cluster.common.sampling_params import SamplingParams  # noqa: E402
from cluster.ray_cluster.config import ClusterConfig, PoolBounds, PoolConfig, ScalingConfig, engine_config_from  # noqa: E402
from cluster.ray_cluster.launcher import Cluster  # noqa: E402

NAME = "scaling-step"
ARMS = ("fixed", "scaling")
SAMPLE_S = 0.5  # how often the pools' sizes are read
SPARE_TIMEOUT_S = 300.0  # far longer than a spare's model load and warm-up, even on a loaded machine


def workload(args: argparse.Namespace) -> list[TimedRequest]:
    """Poisson arrivals at the low rate, then the high rate, then the low rate again; then the prompts."""
    rng = np.random.default_rng(args.seed)
    arrivals: list[float] = []
    begin = 0.0
    for duration, rate in zip(args.phases, (args.low_rate, args.high_rate, args.low_rate), strict=True):
        arrivals += ArrivalProcess(rate).times_until(rng, begin + duration, start=begin)
        begin += duration
    return timed_requests(rng, arrivals, RequestShape((64, 192), (args.output_tokens,) * 2))


def cluster_config(arm: str, args: argparse.Namespace) -> ClusterConfig:
    engine = engine_config_from({"kv_cache_memory_gb": 1.0})
    scaling = ScalingConfig(enabled=arm == "scaling", prefill=PoolBounds(1, 1), decode=PoolBounds(1, args.max_decode),
                            queue_depth=args.queue_depth, ttft_s=0, itl_s=0, scale_down_below=0.3,
                            sustain_s=args.sustain, scale_down_sustain_s=args.scale_down_sustain,
                            cooldown_s=args.cooldown, interval_s=0.5, drain_timeout_s=60.0,
                            warm_spares=args.warm_spares)
    prefill = PoolConfig(replicas=1, num_cpus=0.5, threads=1)
    decode = PoolConfig(replicas=1, num_cpus=0.5, threads=1, engine={"max_num_seqs": args.max_num_seqs})
    return ClusterConfig(prefill=prefill, decode=decode, engine=engine, max_prefill_wait_s=0, max_decode_wait_s=0,
                         scaling=scaling)


async def sample_pools(cluster: Cluster, start: float, samples: list[tuple[float, int]]) -> None:
    """Until cancelled: the decode pool's size every SAMPLE_S (seconds from the arm's start, workers)."""
    while True:
        sizes = (await cluster.scaling()).get("pools", {}) if cluster.scaler is not None else {}
        samples.append((time.perf_counter() - start, sizes.get("decode", len(cluster.decode))))
        await asyncio.sleep(SAMPLE_S)


async def drive(cluster: Cluster, specs: list[TimedRequest], args: argparse.Namespace, arm: str) -> dict[str, Any]:
    """Send every request at its time, read the pools meanwhile; the records and the pool samples."""
    records = [Record.of(s) for s in specs]
    samples: list[tuple[float, int]] = []
    start, start_wall = time.perf_counter(), time.time()
    sampler = asyncio.create_task(sample_pools(cluster, start, samples))
    tasks = [asyncio.create_task(send(cluster, s, r, start, arm)) for s, r in zip(specs, records, strict=True)]
    deadline = sum(args.phases) + args.drain
    with console.status(arm) as status:
        while not all(task.done() for task in tasks) and time.perf_counter() - start < deadline:
            status.update(f"{arm}: {time.perf_counter() - start:5.1f} s, {sum(t.done() for t in tasks)}/{len(tasks)}"
                          f" done, decode workers {samples[-1][1] if samples else '?'}")
            await asyncio.sleep(0.5)
    sampler.cancel()
    settle(tasks, records, deadline)
    await asyncio.gather(*tasks, sampler, return_exceptions=True)
    scaling = await cluster.scaling()
    return {"records": records, "pool_samples": samples, "scaling": scaling,
            "decisions": decisions(scaling, start_wall, records)}


def meets(record: Record, args: argparse.Namespace) -> bool:
    per_token = record.tpot_s
    return record.error is None and record.ttft_s is not None and record.ttft_s <= args.slo_ttft \
        and per_token is not None and per_token <= args.slo_tpot


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def windows(records: list[Record], args: argparse.Namespace) -> list[dict[str, Any]]:
    """TTFT, TPOT and attainment of the requests sent in each window."""
    rows = []
    for begin in np.arange(0, sum(args.phases), args.window):
        sent = [r for r in records if begin <= r.planned_s < begin + args.window]
        ttft = [r.ttft_s for r in sent if r.ttft_s is not None]
        per_token = [t for r in sent if (t := r.tpot_s) is not None]
        rows.append({"begin_s": float(begin), "requests": len(sent), "ttft_p50_s": pct(ttft, 50),
                     "ttft_p90_s": pct(ttft, 90), "tpot_p50_s": pct(per_token, 50), "tpot_p90_s": pct(per_token, 90),
                     "attainment": sum(meets(r, args) for r in sent) / len(sent) if sent else None})
    return rows


def decisions(scaling: dict[str, Any], start_wall: float, records: list[Record]) -> list[dict[str, Any]]:
    """The controller's decisions (`Scaler.status()["history"]`), each with its time from the arm's
    start (`at` is the scaler's wall clock: one host) and its steps' times from there too (`phases`;
    for a worker added, the first request it streamed)."""
    rows = []
    for entry in scaling.get("history", []):
        phases = {key.removesuffix("_at") + "_s": value - start_wall for key, value in entry.get("phases", {}).items()
                  if key.endswith("_at")}
        if entry["direction"] == "up":
            phases.update(first_request(records, entry["worker"]))
        rows.append({**entry, "t_s": entry["at"] - start_wall, "phases_s": phases})
    return rows


def first_request(records: list[Record], worker_id: str) -> dict[str, float]:
    """When the first request that `worker_id` streamed was sent, and when its second token came
    (disaggregated: the first comes from the prefill worker, the next from the decode worker)."""
    served = sorted((r for r in records if worker_id in r.worker_ids and len(r.events) > 1), key=lambda r: r.sent_s)
    if not served:
        return {}
    return {"first_request_sent_s": served[0].sent_s, "first_request_decoded_s": served[0].events[1][0]}


async def capacity(cluster: Cluster, args: argparse.Namespace) -> float:
    """Requests per second one decode worker completes with its slots full: `--max-num-seqs`
    requests of 128-token prompts and `--output-tokens` tokens sent at once, twice; the second."""
    rng = np.random.default_rng(7)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)

    async def one_request(request_id: str) -> None:
        async for _ in cluster.generate(rng.integers(1000, 30000, 128).tolist(), params, request_id=request_id):
            pass

    seconds = 0.0
    for round_ in range(2):
        begin = time.perf_counter()
        await asyncio.gather(*(one_request(f"calibrate-{round_}-{i}") for i in range(args.max_num_seqs)))
        seconds = time.perf_counter() - begin
    return args.max_num_seqs / seconds


def rates(args: argparse.Namespace, measured: float) -> None:
    """The step's rates: given, or `--low-load` and `--high-load` times one decode worker's capacity."""
    args.capacity = measured
    args.low_rate = args.low_rate or round(args.low_load * measured, 3)
    args.high_rate = args.high_rate or round(args.high_load * measured, 3)
    console.print(f"one decode worker: {measured:.2f} requests/s with its {args.max_num_seqs} slots full; "
                  f"rates {args.low_rate:g} -> {args.high_rate:g} -> {args.low_rate:g} requests/s")


async def spares_ready(cluster: Cluster, spares: int) -> None:
    """Wait until the decode pool's warm spares are ready: the arm starts as a cluster that ran a
    while, not with a model loading beside its first requests."""
    deadline = time.monotonic() + SPARE_TIMEOUT_S
    while len((await cluster.scaling()).get("spares", {}).get("decode", [])) < spares:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no warm spare ready within {SPARE_TIMEOUT_S:.0f} s (the controller's log says why)")
        await asyncio.sleep(SAMPLE_S)


def run_arm(arm: str, specs: list[TimedRequest], args: argparse.Namespace) -> dict[str, Any]:
    """One arm; the first one measures the capacity and makes the workload (`specs`, filled in)."""
    console.rule(f"[bold]{arm}")
    cluster = Cluster(cluster_config(arm, args)).start()
    try:
        async def run() -> dict[str, Any]:
            await spares_ready(cluster, args.warm_spares if arm == "scaling" else 0)
            await warm_up(cluster)
            measured = await capacity(cluster, args)
            if not specs:
                rates(args, measured)
                specs.extend(workload(args))
                console.print(f"{len(specs)} requests over {sum(args.phases):.0f} s")
            return {**await drive(cluster, specs, args, arm), "capacity": measured}

        driven = asyncio.run(run())
    finally:
        cluster.stop()
    records: list[Record] = driven["records"]
    ok = [r for r in records if r.error is None]
    return {
        "capacity_requests_per_s": driven["capacity"], "requests": len(records), "completed": len(ok),
        "errors": {r.request_id: r.error for r in records if r.error},
        "tokens": sum(r.num_tokens for r in records), "tokens_expected": len(records) * args.output_tokens,
        "attainment": sum(meets(r, args) for r in records) / len(records),
        "ttft_p90_s": pct([r.ttft_s for r in ok if r.ttft_s is not None], 90),
        "tpot_p90_s": pct([t for r in ok if (t := r.tpot_s) is not None], 90),
        "windows": windows(records, args), "pool_samples": driven["pool_samples"],
        "decisions": driven["decisions"], "scaling_status": driven["scaling"],
        "workers_used": sorted({w for r in records for w in r.worker_ids}),
        "load_average_after": os.getloadavg(),
        "records": [{"id": r.request_id, "sent_s": r.sent_s, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
                     "tokens": r.num_tokens, "workers": r.worker_ids, "error": r.error} for r in records],
    }


def plot(results: dict[str, Any], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (latency, pools) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(3, 1))
    for arm, color in zip(ARMS, ("tab:red", "tab:blue"), strict=True):
        if arm not in results:
            continue
        records = results[arm]["records"]
        latency.scatter([r["sent_s"] for r in records if r["tpot_s"]], [r["tpot_s"] * 1000 for r in records
                                                                         if r["tpot_s"]], s=6, color=color, alpha=0.35)
        rows = [w for w in results[arm]["windows"] if w["tpot_p90_s"] is not None]
        latency.step([w["begin_s"] for w in rows], [w["tpot_p90_s"] * 1000 for w in rows], where="post", color=color,
                     label=f"{arm}: TPOT p90 per {args.window:g} s (attainment {results[arm]['attainment']:.0%})")
        seconds, sizes = zip(*results[arm]["pool_samples"], strict=True) if results[arm]["pool_samples"] else ((), ())
        pools.step(seconds, sizes, where="post", color=color, label=arm)
        for decision in results[arm]["decisions"]:
            for ax in (latency, pools):
                ax.axvline(decision["t_s"], color=color, ls=":", lw=1)
            latency.annotate(f"{decision['direction']} ({decision['reason']})", (decision["t_s"], args.slo_tpot * 1000),
                             rotation=90, fontsize=7, color=color, va="bottom")
    step_begin, step_end = args.phases[0], args.phases[0] + args.phases[1]
    for ax in (latency, pools):
        ax.axvspan(step_begin, step_end, color="0.92", zorder=0)
    latency.axhline(args.slo_tpot * 1000, color="0.4", ls="--", lw=1, label=f"SLO TPOT {args.slo_tpot * 1000:g} ms")
    latency.set(ylabel="TPOT ms (dots: requests by send time)", yscale="log",
                title=f"load step {args.low_rate:g} -> {args.high_rate:g} -> {args.low_rate:g} req/s (shaded): "
                      "fixed 1P+1D vs the live controller")
    latency.legend(fontsize=8, loc="upper left")
    pools.set(xlabel="seconds", ylabel="decode workers", yticks=range(1, args.max_decode + 1))
    pools.legend(fontsize=8)
    fig.tight_layout()
    path = result_path(NAME, ".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    console.print(f"[green]wrote {path}")


def lost(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[float]:
    """The windows from the step's start on whose attainment is under `--hold` (their start, s)."""
    return [w["begin_s"] for w in rows if w["begin_s"] >= args.phases[0] and w["attainment"] is not None
            and w["attainment"] < args.hold]


def print_phases(results: dict[str, Any]) -> None:
    """Where the time went between the signal and the new worker serving, per worker added."""
    steps = ("signal_s", "decided_s", "made_s", "loaded_s", "warmed_s", "routed_s", "first_request_sent_s",
             "first_request_decoded_s")
    rows = [[arm, d["worker"], "spare" if d.get("phases", {}).get("spare") else "cold",
             *(f"{d['phases_s'][key]:.1f}" if key in d["phases_s"] else "-" for key in steps)]
            for arm, r in results.items() for d in r["decisions"] if d["direction"] == "up"]
    if rows:
        print_table("workers added: seconds from the arm's start", ["arm", "worker", "how", *steps], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--low-load", type=float, default=0.3, help="before and after the step: this times the "
                        "requests per second one decode worker completes (measured first)")
    parser.add_argument("--high-load", type=float, default=1.3, help="during the step: this times that capacity")
    parser.add_argument("--low-rate", type=float, default=0.0, help="requests per second instead of --low-load")
    parser.add_argument("--high-rate", type=float, default=0.0, help="requests per second instead of --high-load")
    parser.add_argument("--phases", type=float, nargs=3, default=[20.0, 60.0, 40.0], help="seconds of each phase")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=2, help="running requests per decode worker")
    parser.add_argument("--max-decode", type=int, default=2, help="the scaling arm's decode pool bound")
    parser.add_argument("--cooldown", type=float, default=10.0, help="the controller's cooldown_s")
    parser.add_argument("--queue-depth", type=float, default=0.5, help="the controller's queue_depth target")
    parser.add_argument("--sustain", type=float, default=2.0, help="the controller's sustain_s (to grow)")
    parser.add_argument("--scale-down-sustain", type=float, default=5.0, help="its scale_down_sustain_s")
    parser.add_argument("--warm-spares", type=int, default=1, help="the controller's warm_spares (0: cold start)")
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.15)
    parser.add_argument("--window", type=float, default=10.0)
    parser.add_argument("--hold", type=float, default=0.9, help="a window from the step on whose attainment is "
                        "under this is lost; the controller holds the SLO with at most one lost")
    parser.add_argument("--drain", type=float, default=90.0, help="seconds past the last phase to finish")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    args = parser.parse_args()
    info = machine("benchmarks.scaling_step")
    specs: list[TimedRequest] = []  # made by the first arm, from the capacity it measures
    results = {arm: run_arm(arm, specs, args) for arm in args.arms}
    for r in results.values():
        r["windows_lost"] = lost(r["windows"], args)
    rows = [[arm, f"{r['completed']}/{r['requests']}", f"{r['tokens']}/{r['tokens_expected']}",
             f"{r['attainment']:.0%}", f"{len(r['windows_lost'])}", f"{(r['ttft_p90_s'] or 0) * 1000:.0f}",
             f"{(r['tpot_p90_s'] or 0) * 1000:.0f}",
             ", ".join(f"{d['direction']}@{d['t_s']:.0f}s" for d in r["decisions"]) or "-"]
            for arm, r in results.items()]
    print_table("load step", ["arm", "completed", "tokens", "attainment", f"windows < {args.hold:.0%}", "TTFT p90 ms",
                              "TPOT p90 ms", "decisions"], rows)
    print_phases(results)
    for arm, r in results.items():
        print_table(f"{arm} per {args.window:g} s window", ["from s", "requests", "TTFT p90 ms", "TPOT p90 ms",
                                                             "attainment"],
                    [[f"{w['begin_s']:.0f}", w["requests"], f"{(w['ttft_p90_s'] or 0) * 1000:.0f}",
                      f"{(w['tpot_p90_s'] or 0) * 1000:.0f}",
                      "-" if w["attainment"] is None else f"{w['attainment']:.0%}"] for w in r["windows"]])
    save(NAME, {"arguments": vars(args), "results": results}, info)
    plot(results, args)


if __name__ == "__main__":
    main()
