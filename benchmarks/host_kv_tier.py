"""What the host KV tier buys when the prefixes in use outgrow the device pool: the same requests through
an engine without the tier and one with it, alternated in one run.

    python -m benchmarks.host_kv_tier                       # the default model, dtype auto
    python -m benchmarks.host_kv_tier --prefixes 16 --prefix-tokens 256 --pool-fraction 0.25
    python -m benchmarks.host_kv_tier --disk-dir /mnt/nvme/kv   # a third arm: the tier on local disk

The workload: `--prefixes` shared prefixes (a system prompt or a document each) of `--prefix-tokens`
tokens, each request one of them and a suffix of its own (`--suffix-tokens`), `--max-tokens` generated.
Requests visit every prefix once per round, in a new random order each round (`--rounds`), one request
at a time: between two visits of a prefix, every other prefix passed through the pool. The device pool
holds `--pool-fraction` of the prefixes' blocks (0.25: the working set is 4x the pool, so the pool alone
almost never finds a prefix again); the tier holds `--host-factor` times the pool. Per arm: the share of
prompt tokens found in the device pool and in the host tier (exact: counted), time to first token p50
and p90 (each request alone, so it is its prompt's prefill, less what the caches spared), and the tier's
moves. With `--disk-dir`, a third arm holds the same tier in a memory-mapped file there
(`host_kv_disk_dir`). The greedy tokens of the arms are compared. Writes
benchmarks/results/host-kv-tier.<machine>.<date>.json.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import numpy as np

from benchmarks.common import machine, print_table, save
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.llm_engine import LLMEngine

ARMS = ("pool only", "with host tier")
DISK_ARM = "host tier on disk"


def workload(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """Every request's prompt token ids, in arrival order."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, vocab_size) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    prompts = []
    for _ in range(args.rounds):
        for index in rng.sample(range(args.prefixes), args.prefixes):
            prompts.append(prefixes[index] + [rng.randrange(100, vocab_size) for _ in range(args.suffix_tokens)])
    return prompts


def make_engines(args: argparse.Namespace) -> dict[str, LLMEngine]:
    blocks_per_prefix = args.prefix_tokens // args.block_size
    num_blocks = max(int(args.prefixes * blocks_per_prefix * args.pool_fraction),
                     -(-(args.prefix_tokens + args.suffix_tokens + args.max_tokens) // args.block_size) + 1)
    host_blocks = int(num_blocks * args.host_factor)
    arms = {ARMS[0]: (0, ""), ARMS[1]: (host_blocks, "")} | ({DISK_ARM: (host_blocks, args.disk_dir)}
                                                              if args.disk_dir else {})
    return {arm: LLMEngine(EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype),
        cache=CacheConfig(block_size=args.block_size, num_blocks=num_blocks, num_host_kv_blocks=blocks,
                          host_kv_disk_dir=disk_dir))) for arm, (blocks, disk_dir) in arms.items()}


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """The prompts one at a time through a fresh cache: each one's time to first token, and the counters."""
    engine.warm_up()  # also empties both tiers and zeroes their counters
    ttfts, tokens = [], []
    started = time.perf_counter()
    for prompt in prompts:
        request = engine.add_request(prompt, params)
        arrived, first = time.perf_counter(), None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if first is None and output.new_token_ids:
                    first = time.perf_counter()
                if output.finished:
                    tokens.append(list(output.token_ids))
        assert first is not None, request.request_id
        ttfts.append(first - arrived)
    stats = engine.stats()
    tier = stats.host_kv
    host_hits = tier.hits if tier is not None else 0
    return {
        "seconds": time.perf_counter() - started, "ttft_s": ttfts, "tokens": tokens,
        "prompt_tokens": stats.prefix_cache_queries, "device_hit_tokens": stats.prefix_cache_hits - host_hits,
        "host_hit_tokens": host_hits, "offloaded_blocks": tier.offloaded if tier is not None else 0,
        "promoted_blocks": tier.promoted if tier is not None else 0,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm over its repeats: hit rates (the same every repeat: the workload is), TTFT percentiles of
    every request of every repeat."""
    ttfts = np.array([ttft for run_ in runs for ttft in run_["ttft_s"]])
    first = runs[0]
    queries = first["prompt_tokens"]
    return {
        "device_hit_rate": first["device_hit_tokens"] / queries, "host_hit_rate": first["host_hit_tokens"] / queries,
        "hit_rate": (first["device_hit_tokens"] + first["host_hit_tokens"]) / queries,
        "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p90_s": float(np.percentile(ttfts, 90)),
        "ttft_mean_s": float(ttfts.mean()), "seconds_per_repeat": [run_["seconds"] for run_ in runs],
        "offloaded_blocks": first["offloaded_blocks"], "promoted_blocks": first["promoted_blocks"],
        "prompt_tokens": queries, "requests": len(first["ttft_s"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-fraction", type=float, default=0.25,
                        help="the device pool's blocks over the prefixes' blocks (0.25: a working set 4x the pool)")
    parser.add_argument("--host-factor", type=float, default=6.0, help="the host tier's blocks over the pool's")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disk-dir", default="", help="also run the tier on local disk, its file in this directory")
    args = parser.parse_args()
    engines = make_engines(args)
    prompts = workload(args, next(iter(engines.values())).arch.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in engines}
    for _ in range(args.repeats):
        for arm, engine in engines.items():  # alternated: load that comes and goes falls on both arms
            runs[arm].append(run(engine, prompts, params))
    results = {arm: summarize(arm_runs) for arm, arm_runs in runs.items()}
    same = all(run_["tokens"] == runs[ARMS[0]][0]["tokens"] for arm_runs in runs.values() for run_ in arm_runs)
    pool = engines[ARMS[0]].num_blocks
    config = {**vars(args), "num_blocks": pool, "num_host_kv_blocks": engines[ARMS[1]].num_host_kv_blocks,
              "working_set_blocks": args.prefixes * (args.prefix_tokens // args.block_size),
              "dtype_resolved": str(engines[ARMS[0]].dtype).removeprefix("torch.")}
    report(results, same)
    save("host-kv-tier", {"config": config, "same_tokens": same, "results": results},
         machine("benchmarks.host_kv_tier"))


def report(results: dict[str, dict[str, Any]], same: bool) -> None:
    rows = [[arm, f"{r['device_hit_rate']:.1%}", f"{r['host_hit_rate']:.1%}", f"{r['hit_rate']:.1%}",
             r["ttft_p50_s"] * 1000, r["ttft_p90_s"] * 1000, r["offloaded_blocks"], r["promoted_blocks"]]
            for arm, r in results.items()]
    print_table(f"host KV tier (same greedy tokens in both arms: {same})",
                ["arm", "device hits", "host hits", "all hits", "TTFT p50 ms", "TTFT p90 ms", "offloaded",
                 "promoted"], rows)


if __name__ == "__main__":
    main()
