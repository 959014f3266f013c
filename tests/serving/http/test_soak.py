"""The soak: `PDSERVE_SOAK_S` seconds (15 by default) of mixed traffic against a live gateway.

Streamed and whole completions and chats with random lengths, clients that drop streams or cancel
requests wherever they are, invalid requests, all on a tiny model whose small KV pool forces
preemption (by swap, and by recompute once the host space is full) and whose short queue refuses
some requests. Afterwards every request has its outcome, the engine is empty and the process has
not grown. `cluster/bench/soak.py` generates the traffic; `benchmarks/soak.py` runs it for longer.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from cluster.bench.soak import ABORTED, ERROR, FINISHED, KINDS, SoakConfig, rss_bytes, run_soak
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.serving.http.gateway import gateway_of
from tests.helpers import fp32_model
from tests.serving.http.conftest import Gateways, engine_idle, wait_until

SOAK_S = float(os.environ.get("PDSERVE_SOAK_S", "15"))
MAX_RSS_GROWTH = 150 << 20  # generous: what a soak this long might grow by is a few tens of MiB


def soak_config(checkpoint: Path) -> EngineConfig:
    # 64 blocks of 4 tokens (a 256-token context) for up to 8 running requests: preemption is common.
    return EngineConfig(model=fp32_model(checkpoint),
                        cache=CacheConfig(block_size=4, num_blocks=64, num_swap_blocks=16),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_waiting_requests=8, max_num_batched_tokens=64,
                                                  preemption_mode="swap"))


def test_soak_accounts_for_every_request_and_leaves_nothing_behind(gateways: Gateways, tiny_checkpoint: Path) -> None:
    service = gateways.start_service(soak_config(tiny_checkpoint))
    live = gateways.serve(service)
    asyncio.run(run_soak(live.url, SoakConfig(duration_s=0, concurrency=len(KINDS))))  # one of each: warm up
    rss_before = rss_bytes()
    report = asyncio.run(run_soak(live.url, SoakConfig(duration_s=SOAK_S, seed=1)))
    summary = report.summary()
    print(json.dumps(summary, indent=1), "preemptions:", service.engine.scheduler.num_preemptions)  # with -s

    assert report.unexpected() == [], summary["unexpected"]
    outcomes = summary["by_outcome"]
    assert outcomes[FINISHED] and outcomes[ERROR] and outcomes[ABORTED]
    assert set(summary["by_kind"]) == set(KINDS) and all(summary["by_kind"].values())
    assert set(summary["errors_by_status"]) <= {"400", "404", "429"}  # no 5xx, no error inside a stream
    assert summary["completion_tokens"] > 0

    engine = service.engine
    assert wait_until(lambda: engine_idle(service) and not gateway_of(live.app).runs)
    assert not service.worker.streams and not engine.detokenizers and not engine.kv_cache.blocks_of
    assert not engine.runner.swap_store and engine.scheduler.num_swapped_blocks == 0
    growth = rss_bytes() - rss_before
    print(f"RSS {rss_before >> 20} -> {rss_before + growth >> 20} MiB")
    assert growth < MAX_RSS_GROWTH, f"RSS grew by {growth >> 20} MiB"
