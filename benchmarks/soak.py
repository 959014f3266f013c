"""The soak, for longer: mixed traffic against a live gateway, then an account of every request.

    python -m benchmarks.soak                        # 120 s on the default model
    python -m benchmarks.soak --seconds 600 --concurrency 16
    python -m benchmarks.soak --model path/to/checkpoint --seconds 60

The same traffic as `tests/serving/http/test_soak.py` (`cluster/bench/soak.py`: completions and chats, whole
and streamed, clients that drop streams or cancel requests, invalid requests), against one engine
(`LocalService`) behind the HTTP gateway, both in this process on one event loop (the engine steps
in its own thread), with a small KV pool and queue so that preemption and 429s happen. After the
soak the engine must settle with nothing running or waiting and its KV pool whole. Writes
benchmarks/results/soak.<machine>.<date>.json: requests by outcome and kind, completion tokens per second, p50/p99
latency of the finished requests, RSS at the start and end, and the engine's state at the end.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import argparse  # noqa: E402
import asyncio  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import machine, print_table, save  # noqa: E402
from cluster.bench.soak import KINDS, SoakConfig, rss_bytes, run_soak  # noqa: E402
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cluster.serving.http.gateway import HttpServer, build_app  # noqa: E402
from cluster.serving.local_service import LocalService  # noqa: E402

MIB = 1 << 20
SETTLE_S = 60.0


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(model=ModelConfig(model=args.model),
                          cache=CacheConfig(kv_cache_memory_gb=args.kv_cache_memory_gb),
                          scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                                    max_waiting_requests=args.max_waiting_requests,
                                                    preemption_mode=args.preemption_mode))
    service = await LocalService.from_config(config).start()
    server = HttpServer(build_app(service, api_key=""), "127.0.0.1", 0)
    await server.start()
    try:
        await run_soak(server.url, SoakConfig(duration_s=0, concurrency=len(KINDS)))  # one of each: warm up
        rss_start = rss_bytes()
        report = await run_soak(server.url, SoakConfig(duration_s=args.seconds, concurrency=args.concurrency,
                                                       seed=args.seed, max_tokens=args.max_tokens))
        engine = await settle(service)
        rss_end = rss_bytes()
    finally:
        await server.stop()
        await service.stop()
    return {"settings": vars(args), "summary": report.summary(), "engine_at_end": engine,
            "rss_mib": {"start": round(rss_start / MIB, 1), "end": round(rss_end / MIB, 1),
                        "growth": round((rss_end - rss_start) / MIB, 1)}}


async def settle(service: LocalService) -> dict[str, Any]:
    """Wait (up to SETTLE_S) for the engine to have nothing running or waiting and its pool whole."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        (load,) = await service.workers()
        whole = not load.num_running and not load.num_waiting and load.num_free_blocks == load.num_blocks
        if whole or time.monotonic() > deadline:
            return {"whole": whole, "running": load.num_running, "waiting": load.num_waiting,
                    "free_blocks": load.num_free_blocks, "blocks": load.num_blocks,
                    "preemptions": load.num_preemptions}
        await asyncio.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="how long new requests start")
    parser.add_argument("--concurrency", type=int, default=12, help="clients, one request in flight each")
    parser.add_argument("--model", default="default", help="'default', a checkpoint directory or a .gguf file")
    parser.add_argument("--max-tokens", type=int, default=32, help="each request's max_tokens is drawn from 1..this")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=0.015,
                        help="small (21 blocks of 16 tokens on the default model): preemption happens")
    parser.add_argument("--preemption-mode", choices=["swap", "recompute"], default="swap")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-waiting-requests", type=int, default=8, help="a short queue: some requests get 429")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see docs/performance.md on noise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine("benchmarks.soak")
    result = asyncio.run(soak(args))
    summary, engine, rss = result["summary"], result["engine_at_end"], result["rss_mib"]
    print_table(f"soak: {summary['requests']} requests in {summary['duration_s']:.0f}s",
                ["outcome", "requests"], [[outcome, count] for outcome, count in summary["by_outcome"].items()])
    print_table("figures", ["tokens/s", "latency p50 ms", "latency p99 ms", "RSS start MiB", "RSS end MiB",
                            "engine whole", "preemptions"],
                [[summary["tokens_per_s"], summary["latency_ms"]["p50"], summary["latency_ms"]["p99"], rss["start"],
                  rss["end"], engine["whole"], engine["preemptions"]]])
    for line in summary["unexpected"]:
        print("unexpected:", line)
    if not args.no_save:
        save("soak", result, info)


if __name__ == "__main__":
    main()
