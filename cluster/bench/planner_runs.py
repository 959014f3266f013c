"""Real clusters next to the planner's simulator: what `benchmarks.planner_validation` and
`benchmarks.planner_goodput` share.

- `profile_here`: the profile (`--profile`, or measured here on a grid sized to the workload, one
  torch thread as each worker below gets, and saved where the script says);
- `measured_run`: start the real cluster for a `Topology` (embedded Ray, one core and one thread per
  worker, the topology's token budget and batch limit), warm it up, time what serving adds to the
  engine's steps (`measure_serving`: a few requests alone, before the workload), replay the
  workload (every token event timestamped at the client, `cluster.bench.cluster_runs`), stop it;
  meanwhile the front door's CPU (`cluster.planner.front_door`: this process, the router, Ray's
  processes and the workers' threads other than their engine threads) over an idle window, the
  lone requests and the workload gives its idle, per-request and per-token costs;
- `predicted_run` and `compare`: the same requests simulated, percentiles side by side;
  `per_request`: every request's TTFT against its own simulated one.
The importing benchmark sets OMP_NUM_THREADS before torch and Ray load (the workers inherit it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from cluster.bench.cluster_runs import Record, console, drive, send, warm_up
from cluster.bench.workloads import TimedRequest, random_tokens
from cluster.planner.accuracy import per_request_agreement
from cluster.planner.cluster_file import cluster_values
from cluster.planner.front_door import CpuMeter, CpuWindow, OtherLoad, cores_between, front_door_costs
from cluster.planner.measure import MeasureGrid, engine_for, measure
from cluster.planner.profile import Profile, Serving, load_profile
from cluster.planner.simulator import SimResult, Topology, percentile, serving_from_lone_requests
from cluster.planner.workload import RequestSpec
from cluster.ray_cluster.config import ClusterConfig, cluster_config_from
from cluster.ray_cluster.launcher import Cluster

FIGURES = ("ttft", "itl", "tpot")
PROBE_PROMPT = 32  # tokens of the requests that time serving's fixed latencies
LONG_PROBE_PROMPT = 256  # a prompt whose TTFT over the short one's gives the served step factor
PROBE_TOKENS = 12
IDLE_WINDOW_S = 2.0  # the front door's CPU with nothing served
OTHER_LOAD_PERIOD_S = 1.0  # how often the other processes' cores are sampled during the workload
QUIET_OTHER_CORES = 0.25  # a request is in a quiet spell when other processes took less than this


def profile_here(path: str, grid: MeasureGrid, destination: Path) -> Profile:
    """The profile at `path`, or one measured here and saved to `destination`."""
    if path:
        return load_profile(path)
    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    profile = measure(engine_for("default", "auto", grid), grid)
    profile.save(destination)
    console.print(f"profile: {time.monotonic() - started:.0f} s -> {destination}")
    return profile


def specs_for(requests: list[RequestSpec], seed: int) -> list[TimedRequest]:
    """Prompts of random ids (past the special ones) of each request's length; greedy, EOS ignored."""
    rng = np.random.default_rng(seed)
    return [TimedRequest(f"r{index}", "short", request.arrival_s,
                         random_tokens(rng, request.prompt_tokens, (1000, 30000)), request.output_tokens)
            for index, request in enumerate(requests)]


def cluster_config(topology: Topology) -> ClusterConfig:
    """The topology as `pdserve plan --write` writes it, with one core and one thread per worker."""
    values = cluster_values(topology)
    values["engine"]["kv_cache_memory_gb"] = 1.0
    for pool in ("prefill", "decode"):
        if pool in values:
            values[pool].update(num_cpus=1, threads=1)
    return cluster_config_from(values)


async def measure_serving(cluster: Cluster, profile: Profile, topology: Topology, meter: CpuMeter,
                          repeats: int = 3) -> tuple[Serving, CpuWindow]:
    """What this cluster adds to the profile's steps, timed at the client on requests alone
    (`serving_from_lone_requests` turns the medians into `Serving`): the token gap of a
    `PROBE_TOKENS`-token request after its second token (a disaggregated first gap holds the
    transfer), the TTFT of one-token requests (the hops to the worker, through the router's
    reservation round trip when disaggregated, and back), and that of one-token requests of
    `LONG_PROBE_PROMPT` tokens (their difference: the served prefill against the profile's). And the
    front door's CPU over the one-token requests (one request and one token each)."""
    rng = np.random.default_rng(4242)

    async def timed(max_tokens: int, index: int, prompt: int = PROBE_PROMPT) -> Record:
        request = TimedRequest(f"probe-{index}", "short", 0.0, random_tokens(rng, prompt, (1000, 30000)), max_tokens)
        record = Record.of(request)
        await send(cluster, request, record, time.perf_counter(), "serving")
        if record.error is not None or (max_tokens > 1 and len(record.events) < 3):
            raise RuntimeError(f"the serving probe failed: {record.error or record.events}")
        return record

    gaps = []
    for index in range(repeats):
        record = await timed(PROBE_TOKENS, index)
        later = record.events[2:]  # events may carry several tokens: time per token after the second
        gaps.append((record.events[-1][0] - record.events[1][0]) / sum(tokens for _, tokens in later))
    before, started = meter.sample(), time.perf_counter()
    ttfts = [(await timed(1, repeats + index)).ttft_s or 0.0 for index in range(repeats)]
    lone = CpuWindow(meter.window(before, meter.sample())[0], time.perf_counter() - started, repeats, repeats)
    long_ttfts = [(await timed(1, 2 * repeats + index, LONG_PROBE_PROMPT)).ttft_s or 0.0 for index in range(repeats)]
    serving = serving_from_lone_requests(profile, topology, PROBE_PROMPT, statistics.median(ttfts),
                                         statistics.median(gaps), LONG_PROBE_PROMPT, statistics.median(long_ttfts))
    return serving, lone


async def idle_window(meter: CpuMeter, seconds: float = IDLE_WINDOW_S) -> CpuWindow:
    before, started = meter.sample(), time.perf_counter()
    await asyncio.sleep(seconds)
    return CpuWindow(meter.window(before, meter.sample())[0], time.perf_counter() - started)


async def sample_other_load(other: OtherLoad, started: float) -> None:
    """Until cancelled: the other processes' cores, on the clock of the workload's records."""
    while True:
        other.sample(time.perf_counter() - started)
        await asyncio.sleep(OTHER_LOAD_PERIOD_S)


def with_serving(profile: Profile, mode: str, serving: Serving) -> Profile:
    return replace(profile, serving={**profile.serving, mode: serving})


def measured_run(name: str, topology: Topology, specs: list[TimedRequest], args: argparse.Namespace,
                 profile: Profile) -> dict[str, Any]:
    """The run's TTFT, ITL, TPOT and per-request outcomes, and the serving latencies timed first.
    `args` carries `duration` (last arrival) and `drain` (seconds past it to finish)."""
    console.rule(f"[bold]{name}")
    cluster = Cluster(cluster_config(topology)).start()
    meter = CpuMeter()
    other = OtherLoad()
    try:
        async def run() -> tuple[Serving, list[CpuWindow], list[Record]]:
            await warm_up(cluster)
            idle = await idle_window(meter)
            serving, lone = await measure_serving(cluster, profile, topology, meter)
            before, started = meter.sample(), time.perf_counter()
            sampler = asyncio.create_task(sample_other_load(other, started))
            records = await drive(cluster, specs, name, args.duration + args.drain)
            sampler.cancel()
            front_door = meter.window(before, meter.sample())[0]
            served = [r for r in records if r.error is None and r.events]
            loaded = CpuWindow(front_door, time.perf_counter() - started, len(served),
                               sum(r.num_tokens for r in served))
            return serving, [idle, lone, loaded], records

        serving, windows, records = asyncio.run(run())
    finally:
        cluster.stop()
    idle_cores, request_cpu_s, token_cpu_s = front_door_costs(*windows)
    serving = replace(serving, front_door_idle_cores=idle_cores, front_door_request_cpu_s=request_cpu_s,
                      front_door_token_cpu_s=token_cpu_s)
    ok = [r for r in records if r.error is None and r.events]
    return {"ttft": [r.ttft_s for r in ok], "itl": [gap for r in ok for gap in r.gaps_s],
            "tpot": [(r.events[-1][0] - r.events[0][0]) / (r.num_tokens - 1) for r in ok if r.num_tokens > 1],
            "requests": [{"id": r.request_id, "ttft_s": r.ttft_s,
                          "tpot_s": (r.events[-1][0] - r.events[0][0]) / (r.num_tokens - 1)
                          if r.num_tokens > 1 else 0.0, "finished_s": r.finished_s, "sent_s": r.sent_s}
                         for r in ok],
            "serving": serving, "front_door_windows": [asdict(window) for window in windows],
            "other_load": other.timeline(),
            "failed": len(records) - len(ok), "errors": sorted({r.error for r in records if r.error})[:5]}


def predicted_run(result: SimResult) -> dict[str, list[float]]:
    return {"ttft": [r.ttft_s for r in result.requests], "itl": [g for r in result.requests for g in r.itls_s],
            "tpot": [r.tpot_s for r in result.requests if len(r.token_times) > 1]}


def per_request(measured: dict[str, Any], result: SimResult, specs: list[TimedRequest]) -> dict[str, Any]:
    """Each measured request's TTFT next to its simulated one (by id; the simulation keeps the specs'
    order) and the cores other processes on the host took while it waited for its first token; how
    well they agree (`accuracy.per_request_agreement`), over all and over the requests that waited in
    a quiet spell (other processes under `QUIET_OTHER_CORES`): on a loaded machine those say what
    the model gets wrong, the rest what the machine did."""
    simulated = {spec.request_id: (spec, r.ttft_s) for spec, r in zip(specs, result.requests, strict=True)}
    rows = [{"id": m["id"], "arrival_s": simulated[m["id"]][0].arrival_s, "prompt": len(simulated[m["id"]][0].prompt),
             "output": simulated[m["id"]][0].max_tokens, "measured_ttft_s": m["ttft_s"],
             "predicted_ttft_s": simulated[m["id"]][1],
             "other_cores": cores_between(measured["other_load"], m["sent_s"], m["sent_s"] + m["ttft_s"])}
            for m in measured["requests"] if m["id"] in simulated]
    quiet = [row for row in rows if row["other_cores"] < QUIET_OTHER_CORES]
    agreement = per_request_agreement({row["id"]: row["measured_ttft_s"] for row in rows},
                                      {row["id"]: row["predicted_ttft_s"] for row in rows})
    in_quiet = per_request_agreement({row["id"]: row["measured_ttft_s"] for row in quiet},
                                     {row["id"]: row["predicted_ttft_s"] for row in quiet})
    return {**agreement, "quiet": in_quiet, "rows": rows}


def compare(measured: dict[str, Any], predicted: dict[str, list[float]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for figure in FIGURES:
        for q in (50, 90):
            real, model = percentile(measured[figure], q), percentile(predicted[figure], q)
            rows[f"{figure}_p{q}"] = {"measured_s": real, "predicted_s": model, "error": model / real - 1}
    return rows
