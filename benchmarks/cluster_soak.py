"""The soak against the Ray cluster, for longer, with decode workers killed along the way.

    python -m benchmarks.cluster_soak                          # 120 s, tiny random model, 1 prefill + 2 decode
    python -m benchmarks.cluster_soak --decode 1 --seconds 300  # the default shape: kills wait for a restart
    python -m benchmarks.cluster_soak --model default --kills 3

The traffic of `cluster/bench/soak.py` (completions and chats, whole and streamed, dropped streams,
cancels, invalid requests) through the HTTP gateway to a disaggregated cluster on an embedded Ray;
`--kills` times, evenly spread, a decode worker's process is killed (Ray restarts it). Afterwards
every request must be accounted for (finished, an explicit error, or aborted by its client: the
`unexpected` count is the one that matters) and every pool whole. Writes
benchmarks/results/cluster-soak.<machine>.<date>.json. The short version, with a Redis restart too, is
`tests/ray_cluster/test_cluster_soak.py`.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import argparse  # noqa: E402
import asyncio  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import machine, print_table, save  # noqa: E402
from cluster.bench.soak import SoakConfig, run_soak  # noqa: E402
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from  # noqa: E402
from cluster.ray_cluster.launcher import Cluster, shutdown_ray  # noqa: E402
from cluster.serving.cluster_service import ClusterService  # noqa: E402
from cluster.serving.http.gateway import HttpServer, build_app  # noqa: E402
from cluster.weights.synthetic import build_tiny_llama_checkpoint  # noqa: E402

SETTLE_S = 120.0


async def soak(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    import ray

    http = HttpServer(build_app(ClusterService(cluster), api_key=""), "127.0.0.1", 0)
    await http.start()
    kills: list[float] = []
    try:
        started = time.monotonic()
        traffic = asyncio.create_task(run_soak(http.url, SoakConfig(
            duration_s=args.seconds, concurrency=args.concurrency, seed=args.seed, max_tokens=args.max_tokens)))
        for kill in range(args.kills):
            await asyncio.sleep(args.seconds / (args.kills + 1))
            ray.kill(cluster.decode[kill % len(cluster.decode)], no_restart=False)
            kills.append(round(time.monotonic() - started, 1))
        report = await traffic
    finally:
        await http.stop()
    return {"settings": vars(args), "kills_at_s": kills, "summary": report.summary(),
            "pools_whole": await asyncio.to_thread(settle, cluster),
            "router": dict(ray.get(cluster.router.stats.remote(), timeout=30))}


def settle(cluster: Cluster) -> bool:
    """Whether every worker's pool is whole within SETTLE_S (restarted workers included)."""
    import ray

    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        try:
            states = ray.get([w.pool_state.remote() for w in cluster.prefill + cluster.decode], timeout=30)
        except Exception:  # a worker still restarting
            states = [(0, 1)]
        if all(free == total for free, total in states):
            return True
        time.sleep(0.5)
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long new requests start")
    parser.add_argument("--concurrency", type=int, default=10, help="clients, one request in flight each")
    parser.add_argument("--model", default="tiny", help="'tiny' (a random-weight checkpoint built here), "
                        "'default', or a checkpoint directory")
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--kills", type=int, default=2, help="decode worker processes killed, evenly spread")
    parser.add_argument("--max-tokens", type=int, default=32, help="each request's max_tokens is drawn from 1..this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    info = machine("benchmarks.cluster_soak")
    model = args.model
    if model == "tiny":
        model = str(build_tiny_llama_checkpoint(Path(tempfile.mkdtemp(prefix="pdserve-soak-"))))
    engine = engine_config_from({"model": model, "block_size": 4 if args.model == "tiny" else 16,
                                 "num_blocks": 256, "max_num_seqs": 8})
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1),
                           decode=PoolConfig(replicas=args.decode, num_cpus=0.1), engine=engine)
    cluster = Cluster(config).start()
    try:
        result = asyncio.run(soak(cluster, args))
    finally:
        cluster.stop()
        shutdown_ray()
    summary = result["summary"]
    print_table(f"cluster soak: {summary['requests']} requests in {summary['duration_s']:.0f}s, decode killed at "
                f"{result['kills_at_s']} s", ["outcome", "requests"],
                [[outcome, count] for outcome, count in summary["by_outcome"].items()])
    print_table("figures", ["tokens/s", "latency p50 ms", "latency p99 ms", "pools whole", "resumed", "rejoined"],
                [[summary["tokens_per_s"], summary["latency_ms"]["p50"], summary["latency_ms"]["p99"],
                  result["pools_whole"], result["router"].get("resumed"), result["router"].get("rejoined")]])
    for line in summary["unexpected"]:
        print("unexpected:", line)
    if not args.no_save:
        save("cluster-soak", result, info)


if __name__ == "__main__":
    main()
