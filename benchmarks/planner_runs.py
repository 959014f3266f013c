"""Real clusters next to the planner's simulator: what `planner_validation` and `planner_goodput` share.

- `profile_here`: the profile (`--profile`, or measured here on a grid sized to the workload, one
  torch thread as each worker below gets);
- `measured_run`: start the real cluster for a `Topology` (embedded Ray, one core and one thread per
  worker, the topology's token budget and batch limit), warm it up, time what serving adds to the
  engine's steps (`measure_serving`: a few requests alone, before the workload), replay the
  workload (every token event timestamped at the client, `benchmarks.disaggregation.one`), stop it;
- `predicted_run` and `compare`: the same requests simulated, percentiles side by side.
The importing benchmark sets OMP_NUM_THREADS before torch and Ray load (the workers inherit it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np

from benchmarks.common import RESULTS, console
from benchmarks.disaggregation import Record, Spec, drive, one, warm_up
from cluster.planner.cluster_file import cluster_values
from cluster.planner.measure import MeasureGrid, engine_for, measure
from cluster.planner.profile import Profile, Serving, load_profile
from cluster.planner.simulator import SimResult, Topology, percentile, serving_from_lone_requests
from cluster.planner.workload import RequestSpec
from cluster.ray_cluster.config import ClusterConfig, cluster_config_from
from cluster.ray_cluster.launcher import Cluster

FIGURES = ("ttft", "itl", "tpot")
PROBE_PROMPT = 32  # tokens of the requests that time serving's fixed latencies
PROBE_TOKENS = 12


def profile_here(path: str, grid: MeasureGrid, name: str) -> Profile:
    if path:
        return load_profile(path)
    import torch

    torch.set_num_threads(1)
    started = time.monotonic()
    profile = measure(engine_for("default", "auto", grid), grid)
    profile.save(RESULTS / f"{name}.profile.json")
    console.print(f"profile: {time.monotonic() - started:.0f} s -> {RESULTS / f'{name}.profile.json'}")
    return profile


def specs_for(requests: list[RequestSpec], seed: int) -> list[Spec]:
    """Prompts of random ids (past the special ones) of each request's length; greedy, EOS ignored."""
    rng = np.random.default_rng(seed)
    return [Spec(f"r{index}", "short", request.arrival_s, rng.integers(1000, 30000, request.prompt_tokens).tolist(),
                 request.output_tokens) for index, request in enumerate(requests)]


def cluster_config(topology: Topology) -> ClusterConfig:
    """The topology as `pdserve plan --write` writes it, with one core and one thread per worker."""
    values = cluster_values(topology)
    values["engine"]["kv_cache_memory_gb"] = 1.0
    for pool in ("prefill", "decode"):
        if pool in values:
            values[pool].update(num_cpus=1, threads=1)
    return cluster_config_from(values)


async def measure_serving(cluster: Cluster, profile: Profile, topology: Topology, repeats: int = 3) -> Serving:
    """What this cluster adds to the profile's steps, timed at the client on requests alone
    (`serving_from_lone_requests` turns the medians into `Serving`): the token gap of a
    `PROBE_TOKENS`-token request after its second token (a disaggregated first gap holds the
    transfer), and the TTFT of one-token requests (the hops to the worker, through the router's
    reservation round trip when disaggregated, and back)."""
    rng = np.random.default_rng(4242)

    async def timed(max_tokens: int, index: int) -> Record:
        spec = Spec(f"probe-{index}", "short", 0.0, rng.integers(1000, 30000, PROBE_PROMPT).tolist(), max_tokens)
        record = Record(spec.request_id, spec.kind, PROBE_PROMPT, 0.0)
        await one(cluster, spec, record, time.perf_counter(), "serving")
        if record.error is not None or (max_tokens > 1 and len(record.events) < 3):
            raise RuntimeError(f"the serving probe failed: {record.error or record.events}")
        return record

    gaps = []
    for index in range(repeats):
        record = await timed(PROBE_TOKENS, index)
        later = record.events[2:]  # events may carry several tokens: time per token after the second
        gaps.append((record.events[-1][0] - record.events[1][0]) / sum(tokens for _, tokens in later))
    ttfts = [(await timed(1, repeats + index)).ttft_s or 0.0 for index in range(repeats)]
    return serving_from_lone_requests(profile, topology, PROBE_PROMPT, statistics.median(ttfts),
                                      statistics.median(gaps))


def with_serving(profile: Profile, mode: str, serving: Serving) -> Profile:
    return replace(profile, serving={**profile.serving, mode: serving})


def measured_run(name: str, topology: Topology, specs: list[Spec], args: argparse.Namespace,
                 profile: Profile) -> dict[str, Any]:
    """The run's TTFT, ITL, TPOT and per-request outcomes, and the serving latencies timed first.
    `args` carries `duration` (last arrival) and `drain` (seconds past it to finish)."""
    console.rule(f"[bold]{name}")
    cluster = Cluster(cluster_config(topology)).start()
    try:
        async def run() -> tuple[Serving, list[Record]]:
            await warm_up(cluster, args)
            serving = await measure_serving(cluster, profile, topology)
            return serving, await drive(cluster, specs, args, name)

        serving, records = asyncio.run(run())
    finally:
        cluster.stop()
    ok = [r for r in records if r.error is None and r.events]
    return {"ttft": [r.ttft_s for r in ok], "itl": [gap for r in ok for gap in r.gaps_s],
            "tpot": [(r.events[-1][0] - r.events[0][0]) / (r.num_tokens - 1) for r in ok if r.num_tokens > 1],
            "requests": [{"ttft_s": r.ttft_s, "tpot_s": (r.events[-1][0] - r.events[0][0]) / (r.num_tokens - 1)
                          if r.num_tokens > 1 else 0.0, "finished_s": r.finished_s, "sent_s": r.sent_s}
                         for r in ok],
            "serving": serving, "failed": len(records) - len(ok),
            "errors": sorted({r.error for r in records if r.error})[:5]}


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
