"""KV-aware routing versus load-only and round-robin, on a workload with shared prefixes.

    python -m benchmarks.routing [--duration 60] [--rate 0.25] [--system-tokens 256] [--conversations 3]

Two prefill workers and one decode worker (Ray actors, one torch thread each, KV over UCX), the
default model, prefix caching on. The same workload in each arm, on a fresh cluster (empty caches):
- "chat" requests: one shared system prompt (`--system-tokens` random ids) plus 32 tokens of their
  own, 16 output tokens, Poisson arrivals at `--rate` per second for `--duration` seconds;
- multi-turn conversations (`--conversations`): each turn resends the whole history (previous
  prompt + the reply) plus 48 new tokens, 16 output tokens, the next turn 0.5 s after the reply.

Arms (`routing:` in the cluster config, see cluster/ray_cluster/routing_policy.py):
- kv-aware: a prefill worker by its queued prompt tokens plus the part of this prompt it lacks
  (the router's record of the prefixes it sent where);
- load: by queued prompt tokens only;
- round-robin: in turn.

Per arm: prefix-cache hit rate of the prefill workers (tokens found / looked up, from their
counters), TTFT p50/p99 over all requests, output tokens per second over the arm's makespan, and how
the prompts split between the two prefill workers. Results: benchmarks/results/routing.<machine>.<date>.json/.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and Ray: the workers inherit it
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.common import RESULTS, console, machine, print_table, result_path  # noqa: E402
from cluster.bench.arrivals import ArrivalProcess  # noqa: E402
from cluster.common.sampling_params import SamplingParams  # noqa: E402
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from  # noqa: E402
from cluster.ray_cluster.launcher import Cluster, init_ray  # noqa: E402

NAME = "routing"
ARMS = ("kv-aware", "load", "round-robin")
OUTPUT_TOKENS = 16
PARAMS = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True)


def ids(rng: np.random.Generator, count: int) -> list[int]:
    return rng.integers(1000, 30000, count).tolist()


class Recorder:
    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.tokens = 0
        self.errors: list[str] = []
        self.prefill_workers: dict[str, int] = {}

    async def request(self, cluster: Cluster, prompt: list[int], request_id: str) -> list[int]:
        start, output = time.perf_counter(), []
        try:
            async for event in cluster.generate(prompt, PARAMS, request_id=request_id):
                if event.token_ids and not output:
                    self.ttfts.append(time.perf_counter() - start)
                    self.prefill_workers[event.worker_id] = self.prefill_workers.get(event.worker_id, 0) + 1
                output += event.token_ids
        except Exception as error:  # counted, not fatal: a benchmark reports what happened
            self.errors.append(f"{request_id}: {type(error).__name__}: {error}")
        self.tokens += len(output)
        return output


async def chats(cluster: Cluster, recorder: Recorder, args: argparse.Namespace, system: list[int]) -> None:
    """Poisson arrivals at `--rate` for `--duration` seconds, each sent at its planned time."""
    rng = np.random.default_rng(args.seed + 1)
    arrivals = ArrivalProcess(args.rate).times_until(rng, args.duration)
    start, tasks = time.perf_counter(), []
    for index, at in enumerate(arrivals):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(recorder.request(cluster, system + ids(rng, 32), f"chat-{index}")))
    await asyncio.gather(*tasks)


async def conversation(cluster: Cluster, recorder: Recorder, args: argparse.Namespace, number: int) -> None:
    rng = np.random.default_rng(args.seed + 100 + number)
    history = ids(rng, args.first_turn_tokens)
    start, turn = time.perf_counter(), 0
    while time.perf_counter() - start < args.duration:
        reply = await recorder.request(cluster, history, f"conv-{number}-{turn}")
        history = history + reply + ids(rng, 48)
        turn += 1
        await asyncio.sleep(0.5)


async def drive(cluster: Cluster, args: argparse.Namespace) -> Recorder:
    recorder = Recorder()
    system = ids(np.random.default_rng(args.seed), args.system_tokens)
    await asyncio.gather(chats(cluster, recorder, args, system),
                         *(conversation(cluster, recorder, args, n) for n in range(args.conversations)))
    return recorder


def run_arm(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    engine = engine_config_from({"kv_cache_memory_gb": args.kv_cache_gb, "max_num_batched_tokens": 512})
    config = ClusterConfig(prefill=PoolConfig(replicas=2, num_cpus=0.25), decode=PoolConfig(replicas=1, num_cpus=0.25),
                           engine=engine, routing=policy)
    cluster = Cluster(config).start()
    try:
        started = time.perf_counter()
        with console.status(f"{policy}: {args.duration:.0f} s of arrivals"):
            recorder = asyncio.run(drive(cluster, args))
        makespan = time.perf_counter() - started
        loads = ray.get([w.load.remote() for w in cluster.prefill], timeout=60)
    finally:
        cluster.stop()
    queries = sum(load.prefix_cache_queries for load in loads)
    hits = sum(load.prefix_cache_hits for load in loads)
    ttfts = sorted(recorder.ttfts)
    return {"requests": len(ttfts), "errors": recorder.errors, "prefix_hit_rate": hits / queries if queries else 0.0,
            "prefix_tokens_looked_up": queries, "prefix_tokens_found": hits,
            "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p99_s": float(np.percentile(ttfts, 99)),
            "output_tokens_per_s": recorder.tokens / makespan, "makespan_s": makespan,
            "first_tokens_by_prefill_worker": recorder.prefill_workers}


def plot(results: dict[str, dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(arms, [100 * results[a]["prefix_hit_rate"] for a in arms])
    axes[0].set_title("prefix-cache hit rate (% of prompt tokens)")
    width = 0.38
    xs = np.arange(len(arms))
    axes[1].bar(xs - width / 2, [results[a]["ttft_p50_s"] * 1e3 for a in arms], width, label="p50")
    axes[1].bar(xs + width / 2, [results[a]["ttft_p99_s"] * 1e3 for a in arms], width, label="p99")
    axes[1].set_xticks(xs, arms)
    axes[1].set_title("time to first token (ms)")
    axes[1].legend()
    axes[2].bar(arms, [results[a]["output_tokens_per_s"] for a in arms])
    axes[2].set_title("output tokens per second")
    fig.suptitle("Prefill routing on a shared-prefix workload (2 prefill + 1 decode worker)")
    fig.tight_layout()
    fig.savefig(result_path(NAME, ".png"), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=0.25, help="chat requests per second (Poisson)")
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--first-turn-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    init_ray()
    info = machine("benchmarks.routing")
    results = {arm: run_arm(arm, args) for arm in args.arms}
    print_table("Prefill routing on shared prefixes", ["arm", "requests", "hit rate", "TTFT p50 ms", "TTFT p99 ms",
                                                       "tokens/s", "split", "errors"],
                [[arm, r["requests"], f"{100 * r['prefix_hit_rate']:.1f}%", f"{r['ttft_p50_s'] * 1e3:.0f}",
                  f"{r['ttft_p99_s'] * 1e3:.0f}", f"{r['output_tokens_per_s']:.1f}",
                  str(r["first_tokens_by_prefill_worker"]), len(r["errors"])] for arm, r in results.items()])
    if args.no_save:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(NAME)
    path.write_text(json.dumps({"benchmark": NAME, "machine": info, "workload": vars(args), "arms": results},
                               indent=1) + "\n")
    plot(results)
    console.print(f"[green]wrote {path}")


if __name__ == "__main__":
    main()
