"""How fast the cluster recovers from a decode worker's crash: the requests in flight finish (on the other
decode worker, or on the crashed one once Ray restarted it), and the restarted worker rejoins routing.

    python -m benchmarks.recovery                                  # tiny random-weight model, 1P + 2D
    python -m benchmarks.recovery --model default --decode 1 --requests 6 --max-tokens 300 --kill-after-s 2 \
        [--deterministic]                                          # `make serve`'s shape and model

Each of `--runs` rounds runs the requests (greedy, EOS ignored) undisturbed, then again with the decode
worker streaming them killed (`ray.kill(no_restart=False)`: a crash, Ray starts it again) once every
request is streaming, or `--kill-after-s` after they were sent. Reported per round: the undisturbed
time, each stream's end after the kill (first and last), whether every resumed text equals the
undisturbed one, and the router's recovery timeline (pdserve:worker_recovery_seconds: Ray's restart,
the model load, the rest of the worker's start, its warm-up, back in routing). Writes
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
                       crash: Any = None, kill_after_s: float = 0.0) -> dict[str, Any]:
    """Every stream's text and end time; with `crash`, the monotonic time of the kill too."""
    started = time.monotonic()
    streaming = [0] * len(prompts)
    texts = [""] * len(prompts)
    ends = [0.0] * len(prompts)

    async def one(index: int) -> None:
        async for event in cluster.generate(prompts[index], params, request_id=f"{tag}-{index}"):
            streaming[index] += len(event.token_ids)
            texts[index] += event.text
        ends[index] = time.monotonic()

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    crashed_at = 0.0
    if crash is not None:
        import ray

        while min(streaming) < 8 or time.monotonic() - started < kill_after_s:
            await asyncio.sleep(0.005)
        ray.kill(crash, no_restart=False)
        crashed_at = time.monotonic()
    await asyncio.gather(*tasks)
    return {"seconds": max(ends) - started, "texts": texts, "crashed_at": crashed_at,
            "ends_after_kill": sorted(end - crashed_at for end in ends) if crash is not None else []}


def router_counts(cluster: Cluster) -> tuple[dict[str, int], dict[str, float]]:
    stats = asyncio.run(cluster.router_stats())
    return stats["decisions"], stats["recoveries"]


def one_round(cluster: Cluster, prompts: list[list[int]], params: SamplingParams, run: int,
              kill_after_s: float) -> dict[str, Any]:
    baseline = asyncio.run(run_requests(cluster, prompts, params, f"base{run}"))
    before, recovered_before = router_counts(cluster)
    crashed = asyncio.run(run_requests(cluster, prompts, params, f"crash{run}", cluster.decode[0], kill_after_s))
    while router_counts(cluster)[0]["rejoined"] == before["rejoined"]:
        time.sleep(0.05)
    decisions, recovered = router_counts(cluster)
    timeline = {phase: seconds - recovered_before.get(phase, 0.0) for phase, seconds in recovered.items()
                if phase != "count"}
    return {"baseline_s": baseline["seconds"], "with_crash_s": crashed["seconds"],
            "slowdown": crashed["seconds"] / baseline["seconds"],
            "first_stream_end_after_kill_s": crashed["ends_after_kill"][0],
            "last_stream_end_after_kill_s": crashed["ends_after_kill"][-1],
            "texts_equal_undisturbed": sum(a == b for a, b in zip(crashed["texts"], baseline["texts"], strict=True)),
            "resumed_requests": decisions["resumed"] - before["resumed"], "recovery_timeline_s": timeline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model", default="", help="a checkpoint, or `default`; none: a tiny random-weight one")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--decode", type=int, default=2, help="decode workers (the first is killed)")
    parser.add_argument("--deterministic", action="store_true", help="deterministic mode (`--deterministic`)")
    parser.add_argument("--kill-after-s", type=float, default=0.0, help="kill no sooner than this after sending")
    args = parser.parse_args()

    model = args.model
    if not model:
        from cluster.weights.synthetic import build_tiny_llama_checkpoint

        model = str(build_tiny_llama_checkpoint(Path(tempfile.mkdtemp(prefix="recovery-"))))
    engine = engine_config_from({"model": model, "dtype": args.dtype, "num_blocks": 1024,
                                 "deterministic": args.deterministic})
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1),
                           decode=PoolConfig(replicas=args.decode, num_cpus=0.1), engine=engine,
                           worker_max_restarts=args.runs)
    prompts = [[3 + (5 * i + 7 * j) % 290 for j in range(24)] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    cluster = Cluster(config).start()
    runs = []
    try:
        asyncio.run(run_requests(cluster, prompts, params, "warm"))
        for run in range(args.runs):
            runs.append(one_round(cluster, prompts, params, run, args.kill_after_s))
            print(json.dumps(runs[-1]), flush=True)
    finally:
        cluster.stop()
    summary = {"machine": machine("benchmarks.recovery"), "model": args.model or "tiny", "dtype": args.dtype,
               "deterministic": args.deterministic,
               "decode_workers": args.decode, "requests": args.requests, "max_tokens": args.max_tokens,
               "kill_after_s": args.kill_after_s, "runs": runs,
               "median_slowdown": statistics.median(r["slowdown"] for r in runs),
               "median_last_stream_end_after_kill_s": statistics.median(r["last_stream_end_after_kill_s"]
                                                                        for r in runs)}
    RESULTS.mkdir(exist_ok=True)
    name = "recovery" if not args.model else f"recovery-{Path(args.model).name}-{args.decode}d"
    path = result_path(name + ("-deterministic" if args.deterministic else ""))
    path.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
