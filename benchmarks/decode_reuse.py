"""Decode-side prefix reuse and conditional disaggregation on a multi-turn chat: KV shipped and TTFT per turn.

    python -m benchmarks.decode_reuse [--turns 8] [--conversations 3] [--local-threshold 128]

One prefill and one decode worker (Ray actors, KV over the cluster's transport), the default model
(dtype auto), prefix caching on. A conversation: a first message of `--first-turn-tokens` random ids,
then `--turns` - 1 more, each resending the whole history (every earlier message and reply) plus
`--user-tokens` new ones; replies of `--reply-tokens` greedy tokens. Conversations run one after the
other, each turn after the last reply. The same conversations in each arm, on a fresh cluster:
- off: every turn's KV travels whole from the prefill worker (`decode_prefix_reuse: false`);
- reuse: the decode worker keeps the blocks it holds, only the rest is prefilled and sent;
- reuse+local: as reuse, and an uncached rest under `--local-threshold` tokens is computed on the
  decode worker (`local_prefill_threshold`), no prefill worker asked.

Per arm and turn: KV bytes and blocks the prefill worker sent (its counters, exact), the prompt
tokens the decode worker reused, and the time to first token (median over conversations). Results:
benchmarks/results/decode-reuse.<machine>.<date>.json/.png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.common import console, machine, png_path, print_table, save
from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from
from cluster.ray_cluster.launcher import Cluster, init_ray

NAME = "decode-reuse"
ARMS = ("off", "reuse", "reuse+local")


def conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Each conversation's new tokens per turn (the replies are the model's, known only when run)."""
    rng = np.random.default_rng(args.seed)
    return [[rng.integers(1000, 30000, args.first_turn_tokens if turn == 0 else args.user_tokens).tolist()
             for turn in range(args.turns)] for _ in range(args.conversations)]


def arm_config(arm: str, args: argparse.Namespace) -> ClusterConfig:
    engine = engine_config_from({"model": args.model, "kv_cache_memory_gb": args.kv_cache_gb,
                                 "max_num_batched_tokens": 2048})
    return ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.25), decode=PoolConfig(replicas=1, num_cpus=0.25),
                         engine=engine, decode_prefix_reuse=arm != "off",
                         local_prefill_threshold=args.local_threshold if arm == "reuse+local" else 0)


def counters(cluster: Cluster) -> tuple[WorkerLoad, WorkerLoad]:
    loads = {load.role: load for load in asyncio.run(cluster.workers())}
    return loads["prefill"], loads["decode"]


def one_turn(cluster: Cluster, prompt: list[int], params: SamplingParams, request_id: str) -> tuple[list[int], float]:
    async def run() -> tuple[list[int], float]:
        started, ttft, tokens = time.perf_counter(), 0.0, []
        async for event in cluster.generate(prompt, params, request_id=request_id):
            if event.token_ids and not tokens:
                ttft = time.perf_counter() - started
            tokens += event.token_ids
        return tokens, ttft

    return asyncio.run(run())


def run_arm(arm: str, messages: list[list[list[int]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)
    cluster = Cluster(arm_config(arm, args)).start()
    turns: list[dict[str, Any]] = [{"turn": turn + 1, "ttft_s": [], "kv_bytes": [], "kv_blocks": [],
                                    "reused_tokens": [], "local_prefills": [], "prompt_tokens": []}
                                   for turn in range(args.turns)]
    try:
        for number, conversation in enumerate(messages):
            history: list[int] = []
            for turn, new in enumerate(conversation):
                prompt = history + new
                prefill, decode = counters(cluster)
                with console.status(f"{arm}: conversation {number + 1}, turn {turn + 1} ({len(prompt)} tokens)"):
                    reply, ttft = one_turn(cluster, prompt, params, f"{arm}-{number}-{turn}")
                after_prefill, after_decode = counters(cluster)
                row = turns[turn]
                row["prompt_tokens"].append(len(prompt))
                row["ttft_s"].append(ttft)
                row["kv_bytes"].append(after_prefill.kv_transfer_bytes - prefill.kv_transfer_bytes)
                row["kv_blocks"].append(after_prefill.kv_transfer_blocks - prefill.kv_transfer_blocks)
                row["reused_tokens"].append(after_decode.decode_reused_prompt_tokens
                                            - decode.decode_reused_prompt_tokens)
                row["local_prefills"].append(after_decode.local_prefills - decode.local_prefills)
                history = prompt + reply
        prefill, decode = counters(cluster)
        if prefill.kv_transfer_failures or decode.kv_recomputes:
            console.print(f"[red]{arm}: {prefill.kv_transfer_failures} failed transfers, "
                          f"{decode.kv_recomputes} recomputes")
    finally:
        cluster.stop()
    for row in turns:
        row["ttft_median_s"] = statistics.median(row["ttft_s"])
    return turns


def plot(results: dict[str, list[dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for arm, turns in results.items():
        numbers = [row["turn"] for row in turns]
        axes[0].plot(numbers, [statistics.mean(row["kv_bytes"]) / 2**20 for row in turns], marker="o", label=arm)
        axes[1].plot(numbers, [row["ttft_median_s"] * 1e3 for row in turns], marker="o", label=arm)
    axes[0].set_title("KV shipped per turn (MiB)")
    axes[1].set_title("time to first token per turn (ms, median)")
    for axis in axes:
        axis.set_xlabel("turn")
        axis.legend()
    fig.suptitle("Multi-turn chat, 1 prefill + 1 decode worker")
    fig.tight_layout()
    fig.savefig(png_path(NAME), dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--first-turn-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=48)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--local-threshold", type=int, default=128)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    init_ray()
    info = machine("benchmarks.decode_reuse")
    messages = conversations(args)
    results = {arm: run_arm(arm, messages, args) for arm in args.arms}
    print_table("KV shipped (KiB) and TTFT (ms, median) per turn", ["turn", "prompt tokens", *(
        f"{arm} {what}" for arm in results for what in ("KiB", "TTFT"))],
                [[index + 1, statistics.mean(results[args.arms[0]][index]["prompt_tokens"]), *(
                    value for arm in results for value in (
                        f"{statistics.mean(results[arm][index]['kv_bytes']) / 1024:.0f}",
                        f"{results[arm][index]['ttft_median_s'] * 1e3:.0f}"))] for index in range(args.turns)])
    if not args.no_save:
        save(NAME, {"workload": vars(args), "arms": results}, info)
        plot(results)


if __name__ == "__main__":
    main()
