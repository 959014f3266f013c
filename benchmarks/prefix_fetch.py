"""Prefix fetch between prefill workers: a cold prefill worker joins a warm one, and bursts of
questions about long documents arrive. Prompt tokens each worker computed, blocks fetched, TTFT.

    python -m benchmarks.prefix_fetch [--documents 4] [--document-tokens 512] [--bursts 6] [--concurrency 4]

Two prefill workers and one decode worker (Ray actors, KV over the cluster's transport), the default
model (dtype auto), prefix caching on, KV-aware routing without Redis. First every document is sent
once, one after the other: the first prefill worker computes and caches them all (ties go to it), the
second stays cold, as a worker the scaler just added. Then `--bursts` bursts of `--concurrency`
requests at once, each a document (drawn at random) followed by `--question-tokens` new ones, replies
of `--reply-tokens` greedy tokens. The same workload in each arm, on a fresh cluster:
- off: a prefill worker computes whatever its own cache lacks (`prefix_fetch: false`), so the router
  keeps sending the documents' questions to the warm worker until its queue outweighs a recompute;
- fetch: the cold worker takes a question and fetches its document's blocks from the warm one over the
  KV transfer (`prefix_fetch: true`).

Per arm: prompt tokens each prefill worker computed in the bursts (its prefix-cache queries less its
hits, exact counters), blocks fetched, each burst's makespan and every request's TTFT. Results:
benchmarks/results/prefix-fetch.<machine>.<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.common import console, machine, print_table, save
from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from
from cluster.ray_cluster.launcher import Cluster, init_ray

NAME = "prefix-fetch"
ARMS = ("off", "fetch")


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The documents, and each burst's prompts (a document, then a question)."""
    rng = np.random.default_rng(args.seed)
    documents = [rng.integers(1000, 30000, args.document_tokens).tolist() for _ in range(args.documents)]
    bursts = [[documents[int(rng.integers(args.documents))] + rng.integers(1000, 30000, args.question_tokens).tolist()
               for _ in range(args.concurrency)] for _ in range(args.bursts)]
    return documents, bursts


def arm_config(arm: str, args: argparse.Namespace) -> ClusterConfig:
    engine = engine_config_from({"model": args.model, "kv_cache_memory_gb": args.kv_cache_gb,
                                 "max_num_batched_tokens": 2048})
    # No admission limit: a burst's prompts count whole until their prefill worker is picked (cached tokens too).
    return ClusterConfig(prefill=PoolConfig(replicas=2, num_cpus=0.25), decode=PoolConfig(replicas=1, num_cpus=0.25),
                         engine=engine, prefix_fetch=arm == "fetch", max_prefill_wait_s=0)


def prefill_loads(cluster: Cluster) -> dict[str, WorkerLoad]:
    return {load.worker_id: load for load in asyncio.run(cluster.workers()) if load.role == "prefill"}


async def timed(cluster: Cluster, prompt: list[int], params: SamplingParams, request_id: str) -> float:
    """The request's time to first token."""
    started, ttft = time.perf_counter(), 0.0
    async for event in cluster.generate(prompt, params, request_id=request_id):
        if event.token_ids and not ttft:
            ttft = time.perf_counter() - started
    return ttft


def run_arm(arm: str, documents: list[list[int]], bursts: list[list[list[int]]],
            args: argparse.Namespace) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)
    cluster = Cluster(arm_config(arm, args)).start()
    try:
        for number, document in enumerate(documents):
            with console.status(f"{arm}: document {number + 1} of {len(documents)}"):
                asyncio.run(timed(cluster, document, params, f"{arm}-document-{number}"))
        before = prefill_loads(cluster)
        ttfts: list[float] = []
        makespans: list[float] = []
        for number, prompts in enumerate(bursts):
            with console.status(f"{arm}: burst {number + 1} of {len(bursts)}"):
                started = time.perf_counter()

                async def burst(prompts: list[list[int]] = prompts, number: int = number) -> list[float]:
                    return list(await asyncio.gather(*(timed(cluster, prompt, params, f"{arm}-{number}-{index}")
                                                       for index, prompt in enumerate(prompts))))

                ttfts += asyncio.run(burst())
                makespans.append(time.perf_counter() - started)
        after = prefill_loads(cluster)
        stats = asyncio.run(cluster.router_stats())["decisions"]
    finally:
        cluster.stop()
    computed = {worker: (after[worker].prefix_cache_queries - after[worker].prefix_cache_hits)
                - (before[worker].prefix_cache_queries - before[worker].prefix_cache_hits) for worker in after}
    return {"computed_tokens": computed, "prompt_tokens": sum(len(p) for prompts in bursts for p in prompts),
            "blocks_fetched": sum(load.prefix_blocks_fetched for load in after.values()),
            "prefix_fetches": stats.get("prefix_fetches", 0),
            "prefix_fetch_failed": stats.get("prefix_fetch_failed", 0),
            "ttft_s": ttfts, "ttft_median_s": statistics.median(ttfts),
            "ttft_p90_s": float(np.percentile(ttfts, 90)), "makespan_s": makespans,
            "makespan_median_s": statistics.median(makespans)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--document-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    init_ray()
    info = machine("benchmarks.prefix_fetch")
    documents, bursts = workload(args)
    results = {arm: run_arm(arm, documents, bursts, args) for arm in args.arms}
    print_table("Bursts of questions about cached documents, 2 prefill + 1 decode workers",
                ["arm", "tokens computed per prefill worker", "blocks fetched", "TTFT p50 (ms)", "TTFT p90 (ms)",
                 "burst makespan p50 (ms)"],
                [[arm, " / ".join(str(tokens) for _, tokens in sorted(result["computed_tokens"].items())),
                  result["blocks_fetched"], f"{result['ttft_median_s'] * 1e3:.0f}",
                  f"{result['ttft_p90_s'] * 1e3:.0f}", f"{result['makespan_median_s'] * 1e3:.0f}"]
                 for arm, result in results.items()])
    if not args.no_save:
        save(NAME, {"workload": vars(args), "arms": results}, info)


if __name__ == "__main__":
    main()
