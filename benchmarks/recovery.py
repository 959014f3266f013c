"""How fast the cluster recovers from a worker crash: requests in flight finish on the other worker,
and Ray's restart brings the crashed one back into routing.

    python -m benchmarks.recovery            # tiny random-weight model, 1 prefill + 2 decode workers

Measures, over `--runs` crashes: the time from the crash (`ray.kill(no_restart=False)` of the decode
worker streaming half the requests) until every request in flight has finished, against the same
requests run without a crash in the same run (the ratio is the figure that travels between
machines), and the time until the router routes to the restarted worker again. Writes
benchmarks/results/recovery.<machine>.<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, machine, result_path
from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from
from cluster.ray_cluster.launcher import Cluster


async def run_requests(cluster: Cluster, prompts: list[list[int]], params: SamplingParams, tag: str,
                       crash: Any = None) -> tuple[float, float]:
    """(seconds for every request to finish, the monotonic time of the crash; 0 without one)."""
    started = time.monotonic()
    streaming = [0] * len(prompts)

    async def one(index: int) -> None:
        async for event in cluster.generate(prompts[index], params, request_id=f"{tag}-{index}"):
            streaming[index] += len(event.token_ids)

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    crashed_at = 0.0
    if crash is not None:
        import ray

        while min(streaming) < 8:  # every request is streaming
            await asyncio.sleep(0.005)
        ray.kill(crash, no_restart=False)
        crashed_at = time.monotonic()
    await asyncio.gather(*tasks)
    done = time.monotonic()
    return done - started, crashed_at


def decisions(cluster: Cluster) -> dict[str, int]:
    import ray

    return dict(ray.get(cluster.router.stats.remote(), timeout=30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    from cluster.weights.synthetic import build_tiny_llama_checkpoint

    checkpoint = build_tiny_llama_checkpoint(Path(tempfile.mkdtemp(prefix="recovery-")))
    engine = engine_config_from({"model": str(checkpoint), "block_size": 4, "num_blocks": 512})
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=2, num_cpus=0.1),
                           engine=engine, worker_max_restarts=args.runs)
    prompts = [[3 + (5 * i + 7 * j) % 290 for j in range(24)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    cluster = Cluster(config).start()
    runs = []
    try:
        asyncio.run(run_requests(cluster, prompts, params, "warm"))
        for run in range(args.runs):
            baseline_s, _ = asyncio.run(run_requests(cluster, prompts, params, f"base{run}"))
            before = decisions(cluster)
            crash = run_requests(cluster, prompts, params, f"crash{run}", cluster.decode[0])
            crashed_s, crashed_at = asyncio.run(crash)
            done_at = time.monotonic()
            while decisions(cluster)["rejoined"] == before["rejoined"]:
                time.sleep(0.05)
            runs.append({"baseline_s": baseline_s, "with_crash_s": crashed_s, "slowdown": crashed_s / baseline_s,
                         "resumed_requests": decisions(cluster)["resumed"] - before["resumed"],
                         "crash_to_requests_done_s": done_at - crashed_at,
                         "crash_to_rejoined_s": time.monotonic() - crashed_at})
            print(runs[-1], flush=True)
    finally:
        cluster.stop()
    summary = {"machine": machine("benchmarks.recovery"), "requests": args.requests, "max_tokens": args.max_tokens,
               "runs": runs,
               "median_slowdown": statistics.median(r["slowdown"] for r in runs),
               "median_crash_to_rejoined_s": statistics.median(r["crash_to_rejoined_s"] for r in runs)}
    RESULTS.mkdir(exist_ok=True)
    result_path("recovery").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
