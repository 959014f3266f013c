"""The cluster on a real local Ray: workers as actors, KV over UCX, tokens streamed by the router."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cluster.common.events import TokenEvent
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.ray_cluster.config import ClusterConfig, PoolConfig, engine_config_from, load_cluster_config
from cluster.ray_cluster.launcher import Cluster
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.cpu_binding import parse_cpu_list, split_cpus
from tests.conftest import MAX_TOKENS
from tests.engine.test_engine_outputs import GREEDY, PROMPTS
from tests.helpers import fp32_engine
from tests.ray_cluster.conftest import pace_steps

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def engine_config_for(checkpoint: Path, num_blocks: int = 128) -> EngineConfig:
    return fp32_engine(checkpoint, block_size=4, num_blocks=num_blocks)


def alone(engine_config: EngineConfig, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt's tokens from one engine, one request at a time: what the cluster must reproduce."""
    engine = LLMEngine(engine_config)
    return [engine.generate([prompt], params)[0].token_ids for prompt in prompts]


def generate_all(cluster: Cluster, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    async def one(index: int, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for event in cluster.generate(prompt, params, request_id=f"r{index}"):
            assert event.index == len(tokens)  # in order, each token once
            tokens += event.token_ids
        return tokens

    async def everything() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return asyncio.run(everything())


def assert_pools_whole(cluster: Cluster) -> None:
    """Every worker's KV pool whole, and every router's per-request state empty (nothing in flight)."""
    import ray

    for free, total in ray.get([w.pool_state.remote() for w in cluster.prefill + cluster.decode], timeout=30):
        assert free == total
    deadline = time.monotonic() + 10  # a router's stream ends just after its client read the last event
    while left := [entries for entries in ray.get([router.__ray_call__.remote(router_entries)
                                                   for router in cluster.routers], timeout=30) if entries]:
        assert time.monotonic() < deadline, left
        time.sleep(0.1)


def router_entries(router: Any) -> dict[str, Any]:
    """For `__ray_call__`: what a router still holds for requests (empty when none is in flight)."""
    held = {"attempts": router.attempts, "ahead": router.ahead,
            "in_flight": {key: count for key, count in router.in_flight.items() if count},
            "queued_tokens": {key: count for key, count in router.queued_tokens.items() if count}}
    return {name: entries for name, entries in held.items() if entries}


# Colocated workers' tokens against the engine alone: test_a_worker_killed_mid_stream_is_resumed_elsewhere.
@pytest.mark.parametrize("mode", ["disaggregated"])
def test_two_prefill_two_decode_equal_the_engine_alone(checkpoint: Path, mode: str) -> None:
    import ray

    engine_config = engine_config_for(checkpoint)
    expected = alone(engine_config, PROMPTS, GREEDY)
    config = ClusterConfig(mode=mode, prefill=PoolConfig(replicas=2, num_cpus=0.1),
                           decode=PoolConfig(replicas=2, num_cpus=0.1), engine=engine_config)
    cluster = Cluster(config).start()
    try:
        assert generate_all(cluster, PROMPTS, GREEDY) == expected
        assert_pools_whole(cluster)
        if mode == "disaggregated":
            transfers = [t for w in cluster.prefill for t in ray.get(w.transfers.remote(), timeout=30)]
            assert len(transfers) == len(PROMPTS) and all(t.nbytes > 0 for t in transfers)
            # Workers on one host: the KV went through shared memory (kv_shared_memory, on by default).
            assert {t.transport for t in transfers} == {"shm"}
    finally:
        cluster.stop()


def test_an_fp8_kv_cache_is_computed_shipped_and_read_as_fp8_on_the_cluster_path(checkpoint: Path) -> None:
    """`kv_cache_dtype: fp8` for the cluster: the prefill worker's blocks travel as fp8 (a quarter of fp32's
    bytes) into the decode worker's fp8 cache, and the tokens are the fp8 engine's alone. A decode pool of
    its own in fp8 under an fp32 prefill pool: the sender converts to the ticket's dtype, and nothing is
    recomputed on the decode worker."""
    import ray

    fp32 = engine_config_for(checkpoint)
    fp8 = engine_config_from({"kv_cache_dtype": "fp8"}, base=fp32)
    expected = alone(fp8, PROMPTS, GREEDY)
    head_dim = 64 // 4  # the tiny checkpoint: hidden 64, 4 heads, 2 KV heads, 2 layers, blocks of 4
    fp8_bytes = [-(-len(prompt) // 4) * 2 * 2 * 4 * 2 * head_dim for prompt in PROMPTS]
    for engine, decode_engine in ((fp8, {}), (fp32, {"kv_cache_dtype": "fp8"})):
        config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1),
                               decode=PoolConfig(replicas=1, num_cpus=0.1, engine=decode_engine), engine=engine)
        cluster = Cluster(config).start()
        try:
            got = generate_all(cluster, PROMPTS, GREEDY)
            transfers = ray.get(cluster.prefill[0].transfers.remote(), timeout=30)
            assert sorted(t.nbytes for t in transfers) == sorted(fp8_bytes)
            assert ray.get(cluster.decode[0].load.remote(), timeout=30).kv_recomputes == 0
            if engine is fp8:
                assert got == expected
            else:  # prompts computed on fp32 keys, decoded over fp8 ones: no engine alone does just that
                assert [len(tokens) for tokens in got] == [len(tokens) for tokens in expected]
            assert_pools_whole(cluster)
        finally:
            cluster.stop()


def test_a_dead_decode_worker_sends_requests_to_the_other(checkpoint: Path) -> None:
    import ray

    engine_config = engine_config_for(checkpoint)
    expected = alone(engine_config, PROMPTS, GREEDY)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=2, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()
    try:
        ray.kill(cluster.decode[0])
        assert generate_all(cluster, PROMPTS, GREEDY) == expected
        # Found dead by a request's reservation (rerouted) or, first, by the router's load poll.
        assert ray.get(cluster.router.live_workers.remote(), timeout=30) == ["decode-1", "prefill-0"]
        cluster.decode = cluster.decode[1:]
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


def test_a_worker_whose_engine_thread_fails_is_restarted_and_its_requests_finish_elsewhere(checkpoint: Path) -> None:
    """An exception on a decode worker's engine thread outside a step (here its KV import) ends the
    worker's process, rather than leave the actor alive with a dead thread that Ray would never
    restart: the router sends its requests to the other decode worker, and Ray's restarted worker
    rejoins."""
    import ray

    engine_config = engine_config_for(checkpoint)
    expected = alone(engine_config, PROMPTS, GREEDY)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=2, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()

    def break_kv_import(actor: Any) -> None:
        def corrupt(*_: Any) -> None:
            raise RuntimeError("a KV import that went wrong")

        actor.worker.engine.import_kv = corrupt

    try:
        ray.get(cluster.decode[0].__ray_call__.remote(break_kv_import), timeout=30)
        assert generate_all(cluster, PROMPTS * 2, GREEDY) == expected * 2
        stats = ray_stats(cluster)  # resumed after the first token the prefill streamed, or rerouted before
        assert stats["resumed"] + stats["rerouted"] >= 1, stats
        wait_until_rejoined(cluster, 1)
        assert ray.get(cluster.decode[0].load.remote(), timeout=30).failure == ""  # a fresh process
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


# Each step 200 ms: longer than a Ray call takes even on a busy machine, so step counts are about
# steps, not latency.
LONG_STEP_S = 0.2


def test_an_abort_frees_the_request_on_both_workers_within_two_of_their_steps(checkpoint: Path) -> None:
    """Aborted while its prompt is computed in chunks (the prefill worker computes, the decode worker
    holds the reservation) and again while it decodes: each time every worker that holds it has freed
    its blocks when the abort returns, within 2 of its own steps of the abort, though the request
    could not have ended by itself (hundreds of paced steps were left)."""
    import ray

    engine_config = fp32_engine(checkpoint, block_size=4, num_blocks=256, max_num_batched_tokens=8)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()
    workers = [*cluster.prefill, *cluster.decode]
    long_prompt = (PROMPTS[0] * 40)[:300]  # 38 chunks of 8 tokens
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    def steps() -> list[int]:
        return ray.get([worker.__ray_call__.remote(lambda actor: actor.steps) for worker in workers], timeout=30)

    def loads() -> list[Any]:
        return ray.get([worker.load.remote() for worker in workers], timeout=30)

    async def abort_when(request_id: str, ready: Any) -> tuple[list[int], list[int], list[Any], list[str]]:
        reasons: list[str] = []

        async def stream() -> None:
            async for event in cluster.generate(long_prompt, params, request_id=request_id):
                if event.finished:
                    reasons.append(str(event.finish_reason))

        task = asyncio.create_task(stream())
        deadline = time.monotonic() + 60
        while not ready(loads()):
            assert time.monotonic() < deadline and not task.done(), "the request never reached the phase"
            await asyncio.sleep(0.01)
        before = steps()
        await cluster.abort(request_id)
        after, freed = steps(), loads()
        await asyncio.wait_for(task, 30)
        return before, after, freed, reasons

    try:
        # While the prompt computes, the decode worker holds only a reservation and its steps are idle
        # ticks: paced slower, so that the bound counts steps, not the abort's round trip through the
        # router (on a loaded machine several 0.2 s ticks can pass during it).
        ray.get([cluster.prefill[0].__ray_call__.remote(pace_steps(LONG_STEP_S)),
                 cluster.decode[0].__ray_call__.remote(pace_steps(2 * LONG_STEP_S))], timeout=30)
        prefilling = asyncio.run(abort_when("mid-prefill", lambda now: now[0].num_running == 1
                                            and now[1].num_free_blocks < now[1].num_blocks))
        decoding = asyncio.run(abort_when("mid-decode", lambda now: now[1].num_running == 1))
        for before, after, freed, reasons in (prefilling, decoding):
            assert [load.num_free_blocks for load in freed] == [load.num_blocks for load in freed]
            assert all(late - early <= 2 for early, late in zip(before, after, strict=True)), (before, after)
            assert reasons == ["abort"]
    finally:
        cluster.stop()


def test_prefill_workers_killed_mid_transfer(checkpoint: Path) -> None:
    """Both prefill workers die while they send KV chunk by chunk: the decode worker recomputes every
    prompt cut short, each request still ends with the engine's own tokens. The worker Ray restarts
    rejoins and carries the next prompts' KV again; the one killed for good stays out."""
    import ray

    # Long prompts: many chunks, many frames.
    engine_config = fp32_engine(checkpoint, block_size=4, num_blocks=512, max_num_batched_tokens=8)
    prompts = [[3 + (7 * i + 11 * j) % 290 for j in range(96)] for i in range(6)]
    expected = alone(engine_config, prompts, GREEDY)
    config = ClusterConfig(prefill=PoolConfig(replicas=2, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()

    async def kill_mid_transfer() -> list[list[int]]:
        run = asyncio.gather(*(collect_tokens(cluster, prompt, f"mid-{i}") for i, prompt in enumerate(prompts)))
        deadline = time.monotonic() + 60
        while True:  # some frames sent, not every transfer finished
            loads = [await worker.load.remote() for worker in cluster.prefill]
            if sum(load.kv_frames for load in loads) and sum(load.kv_transfers for load in loads) < len(prompts):
                break
            assert time.monotonic() < deadline, "no transfer under way"
            await asyncio.sleep(0.01)
        ray.kill(cluster.prefill[0], no_restart=False)  # a crash: Ray starts it again
        ray.kill(cluster.prefill[1])  # gone for good
        return list(await asyncio.wait_for(run, 120))

    try:
        assert asyncio.run(kill_mid_transfer()) == expected
        assert ray_stats(cluster)["transfer_failed"] >= 1
        wait_until_rejoined(cluster, 1)
        assert generate_all(cluster, PROMPTS, GREEDY) == alone(engine_config, PROMPTS, GREEDY)
        restarted = ray.get(cluster.prefill[0].load.remote(), timeout=30)
        assert restarted.kv_transfers == len(PROMPTS) and restarted.kv_transfer_failures == 0
        cluster.prefill = cluster.prefill[:1]
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


async def collect_tokens(cluster: Cluster, prompt: list[int], request_id: str,
                         params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for event in cluster.generate(prompt, params, request_id=request_id):
        assert event.index == len(tokens)  # in order, each token once
        tokens += event.token_ids
    return tokens


def wait_until_rejoined(cluster: Cluster, count: int) -> None:
    """Until the router has taken `count` restarted workers back (it polls every 0.5 s)."""
    deadline = time.monotonic() + 60
    while ray_stats(cluster)["rejoined"] < count:
        assert time.monotonic() < deadline, "the restarted worker never rejoined"
        time.sleep(0.2)


@pytest.mark.slow
def test_default_model_through_the_disaggregated_path(default_prompts: list[list[int]],
                                                      transformers_greedy: list[list[int]]) -> None:
    # One worker per pool: each loads the default model, and a second pair would lengthen the suite.
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config_from({"dtype": "float32", "kv_cache_memory_gb": 0.25}))
    cluster = Cluster(config).start()
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        assert generate_all(cluster, default_prompts, params) == transformers_greedy
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


def test_config_file_with_overrides_and_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("mode: disaggregated\nprefill: {replicas: 2}\nengine: {dtype: bfloat16, block_size: 32}\n")
    config = load_cluster_config(path, {"decode": {"replicas": 3}})
    assert config.prefill.replicas == 2 and config.decode.replicas == 3
    assert config.engine.model.dtype == "bfloat16" and config.engine.cache.block_size == 32
    with pytest.raises(ValueError, match="unknown engine key 'blocksize'"):
        load_cluster_config(None, {"engine": {"blocksize": 8}})
    with pytest.raises(ValueError, match="mode must be one of"):
        load_cluster_config(None, {"mode": "split"})
    with pytest.raises(ValueError, match="decode.replicas must be >= 1"):
        load_cluster_config(None, {"decode": {"replicas": 0}})
    with pytest.raises(ValueError, match="unknown cluster config keys"):
        load_cluster_config(None, {"pools": 3})
    assert load_cluster_config(None, {"name": "prod-1", "ray_address": "10.0.0.1:6379"}).name == "prod-1"
    with pytest.raises(ValueError, match="name .* needs ray_address: an embedded Ray ends with the gateway"):
        load_cluster_config(None, {"name": "prod"})
    for bad in ("Prod", "-a", "a_b", "x" * 64):
        with pytest.raises(ValueError, match="name must be lowercase letters, digits and '-'"):
            load_cluster_config(None, {"name": bad, "ray_address": "10.0.0.1:6379"})


def test_kv_aware_routing_with_blocks_the_workers_publish_to_redis(checkpoint: Path, redis_server: Any) -> None:
    """Two prefill workers publish their cached blocks to Redis; prompts sharing a long prefix go to
    the worker that holds it, and the tokens are still the engine's own."""
    engine_config = engine_config_for(checkpoint)
    shared = list(range(200, 240))  # a 40-token "system prompt": 10 blocks
    prompts = [shared + [7 + i, 8 + i, 9 + i] for i in range(4)]
    expected = alone(engine_config, prompts, GREEDY)
    config = ClusterConfig(prefill=PoolConfig(replicas=2, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, redis_url=redis_server.url)
    cluster = Cluster(config).start()
    try:
        # The prefix goes to the second prefill worker, past the router: by load alone (a tie) the
        # router would pick the first.
        asyncio.run(prefill_on(cluster, cluster.prefill[1], prompts[0]))
        assert asyncio.run(wait_for_published_prefix(redis_server.url, cluster, shared)) == "prefill-1"
        got, prefill_ids = generate_with_workers(cluster, prompts[1:])
        assert got == expected[1:]
        assert prefill_ids == ["prefill-1"] * 3  # all to the worker holding the prefix
        assert ray_stats(cluster)["prefix_hits"] >= 3
    finally:
        cluster.stop()


async def prefill_on(cluster: Cluster, prefill: Any, prompt: list[int]) -> None:
    """One request through a chosen prefill worker, doing the router's part by hand."""
    decode = cluster.decode[0]
    address = await decode.reserve.remote("seed", prompt, GREEDY, 30.0)
    async for ref in prefill.prefill.options(num_returns="streaming").remote("seed", prompt, GREEDY, address):
        await ref
    async for ref in decode.stream.options(num_returns="streaming").remote("seed"):
        await ref


async def wait_for_published_prefix(url: str, cluster: Cluster, prefix: list[int]) -> str:
    """The prefill worker whose published blocks hold the prefix (polled: they publish every 0.1 s)."""
    from cluster.common.block_hashes import prefix_hashes
    from cluster.state.connect import connect_state

    state = connect_state(url)
    hashes = prefix_hashes(prefix, 4, cluster.model_name)
    try:
        for _ in range(100):
            held = await state.match(hashes, ["prefill-0", "prefill-1"])
            full = [worker for worker, count in held.items() if count == len(hashes)]
            if full:
                return full[0]
            await asyncio.sleep(0.1)
    finally:
        await state.close()
    raise AssertionError("no prefill worker published the prefix's blocks")


def generate_with_workers(cluster: Cluster, prompts: list[list[int]]) -> tuple[list[list[int]], list[str]]:
    """Tokens of each prompt, one after the other, and the worker that sent each one's first token."""
    async def one(index: int, prompt: list[int]) -> tuple[list[int], str]:
        tokens, first_worker = [], ""
        async for event in cluster.generate(prompt, GREEDY, request_id=f"kv-{index}"):
            first_worker = first_worker or event.worker_id
            tokens += event.token_ids
        return tokens, first_worker

    async def in_order() -> list[tuple[list[int], str]]:
        return [await one(i, p) for i, p in enumerate(prompts)]

    results = asyncio.run(in_order())
    return [tokens for tokens, _ in results], [worker for _, worker in results]


def burst(cluster: Cluster, prompts: list[list[int]], params: SamplingParams,
          indices: range) -> list[list[int] | str]:
    """The prompts at `indices`, sent at once: each one's tokens, or why it was refused (QueueFullError)."""
    from cluster.common.errors import QueueFullError

    async def one(index: int) -> list[int] | str:
        try:
            return [t async for event in cluster.generate(prompts[index], params, request_id=f"burst-{index}")
                    for t in event.token_ids]
        except QueueFullError as error:
            return str(error)

    async def together() -> list[list[int] | str]:
        return list(await asyncio.gather(*(one(index) for index in indices)))

    return asyncio.run(together())


def _stream_states(received: list[list[int]], tasks: list[asyncio.Task[None]]) -> list[str]:
    """Each stream's tokens so far and how it ended, if it did (what a failed wait shows)."""
    def ended(task: asyncio.Task[None]) -> str:
        if not task.done():
            return "streaming"
        return "cancelled" if task.cancelled() else repr(task.exception()) if task.exception() else "finished"

    return [f"{len(tokens)} tokens, {ended(task)}" for tokens, task in zip(received, tasks, strict=True)]


# The decode steps of the kill tests until the kill, paced as a larger model's: every request must be
# streaming before the kill. Unpaced, the first ones would finish their 120-150 tokens in about the
# time the last of a burst may take to start on a loaded machine, and the test would fail before any
# worker was killed.
KILL_TEST_STEP_S = 0.03


def pace_until_killed(cluster: Cluster) -> None:
    import ray

    ray.get([handle.__ray_call__.remote(pace_steps(KILL_TEST_STEP_S)) for handle in cluster.decode], timeout=30)


def ray_stats(cluster: Cluster) -> dict[str, int]:
    import ray

    return dict(ray.get(cluster.router.stats.remote(), timeout=30))


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_worker_killed_mid_stream_is_resumed_elsewhere_and_rejoins(checkpoint: Path, mode: str) -> None:
    """Every one of 20 requests finishes with the engine's own tokens and text, each sent once, though
    the worker streaming half of them dies midway (seeded sampling: a resumed run goes on with the same
    random stream). A stop string that never comes makes every worker hold its last characters back
    (one could be its start): a resumed run sends them, not the text after them only. Ray restarts
    the worker, and it serves new requests again."""
    import ray

    engine_config = engine_config_for(checkpoint, num_blocks=1024)  # room for all 20 on one worker
    params = SamplingParams(max_tokens=120, temperature=0.8, seed=1234, ignore_eos=True, stop=["no such text here"])
    prompts = PROMPTS * 4
    engine = LLMEngine(engine_config)
    outputs = [engine.generate([prompt], params)[0] for prompt in PROMPTS] * 4
    expected, expected_text = [output.token_ids for output in outputs], [output.text for output in outputs]
    # Colocated: with a core kept for the front door (the restarted worker too binds its engine anew).
    split = split_cpus(1, sorted(os.sched_getaffinity(0))) if mode == "colocated" and len(os.sched_getaffinity(0)) > 1 \
        else None
    config = ClusterConfig(mode=mode, prefill=PoolConfig(replicas=1 if mode == "disaggregated" else 0, num_cpus=0.1),
                           decode=PoolConfig(replicas=2, num_cpus=0.1), engine=engine_config,
                           reserved_cpus=1 if split is not None else 0)
    cluster = Cluster(config).start()
    pace_until_killed(cluster)
    received: list[list[int]] = [[] for _ in prompts]
    received_text = ["" for _ in prompts]

    async def one(index: int, prompt: list[int]) -> None:
        async for event in cluster.generate(prompt, params, request_id=f"kill-{index}"):
            assert event.index == len(received[index])  # in order, nothing repeated
            received[index] += event.token_ids
            received_text[index] += event.text

    async def everything() -> None:
        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 120
        while min(len(tokens) for tokens in received) < 10:  # every request is streaming
            assert not any(task.done() for task in tasks) and time.monotonic() < deadline, \
                f"not all streaming: {_stream_states(received, tasks)}"
            await asyncio.sleep(0.005)
        ray.kill(cluster.decode[0], no_restart=False)  # a crash: Ray starts it again
        await asyncio.wait_for(asyncio.gather(*tasks), 120)

    async def served_by() -> set[str]:  # at once: requests spread over the workers in service
        workers: set[str] = set()

        async def one(index: int, prompt: list[int]) -> None:
            async for event in cluster.generate(prompt, GREEDY, request_id=f"after-{index}"):
                workers.add(event.worker_id)

        await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        return workers

    try:
        asyncio.run(everything())
        assert received == expected
        assert received_text == expected_text
        assert ray_stats(cluster)["resumed"] >= 1
        wait_until_rejoined(cluster, 1)
        assert ("decode-0" if mode == "disaggregated" else "colocated-0") in asyncio.run(served_by())
        assert_pools_whole(cluster)
        if split is not None:  # every thread of each worker on the front door's cores but its engine's
            for handle in cluster.decode:
                assert thread_cpus(handle) == {tuple(sorted(split.front_door)), tuple(sorted(split.engines))}
    finally:
        cluster.stop()


def thread_cpus(handle: Any) -> set[tuple[int, ...]]:
    """The CPU sets the threads of a worker actor's process may run on (it runs on this machine)."""
    import ray

    pid = ray.get(handle.__ray_call__.remote(lambda actor: os.getpid()), timeout=30)
    sets = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/status") as status:
            line = next(line for line in status if line.startswith("Cpus_allowed_list"))
            sets.add(tuple(parse_cpu_list(line.split()[1])))
    return sets


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_only_decode_worker_killed_mid_stream_costs_time_not_answers(checkpoint: Path, deterministic: bool) -> None:
    """The default shape (1 prefill + 1 decode): 6 greedy streams of 150 tokens, the decode worker's
    process killed midway. No stream ends with an error: the resumed requests wait for Ray to restart
    the worker and each finishes with the tokens of an undisturbed run, each token once. The router
    reports the recovery's timeline (pdserve:worker_recovery_seconds), its phases within the whole.
    In bf16 with `deterministic`, every token's log-probability too is the undisturbed run's to the
    last bit, though the resumed runs prefilled what had been decoded."""
    import ray

    engine_config = engine_config_for(checkpoint, num_blocks=1024)
    if deterministic:
        engine_config = replace(engine_config, model=replace(engine_config.model, dtype="bfloat16",
                                                             deterministic=True))
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True, logprobs=1 if deterministic else None)
    prompts = (PROMPTS * 2)[:6]
    expected = alone(engine_config, prompts, params)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()
    pace_until_killed(cluster)
    received: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]

    async def one(index: int, prompt: list[int], tag: str) -> None:
        async for event in cluster.generate(prompt, params, request_id=f"{tag}-{index}"):
            assert event.index == len(received[index])  # in order, nothing repeated
            received[index] += event.token_ids
            logprobs[index] += [entry.logprob for entry in event.logprobs]

    async def everything(kill: bool) -> None:
        tasks = [asyncio.create_task(one(i, p, f"kill{kill}")) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 120
        while kill and min(len(tokens) for tokens in received) < 10:
            assert not any(task.done() for task in tasks) and time.monotonic() < deadline, \
                f"not all streaming: {_stream_states(received, tasks)}"
            await asyncio.sleep(0.005)
        if kill:
            ray.kill(cluster.decode[0], no_restart=False)  # a crash: Ray starts it again
        await asyncio.wait_for(asyncio.gather(*tasks), 180)

    try:
        undisturbed = None
        if deterministic:
            asyncio.run(everything(kill=False))
            undisturbed = [list(row) for row in logprobs]
            received, logprobs = [[] for _ in prompts], [[] for _ in prompts]
        asyncio.run(everything(kill=True))
        assert received == expected
        assert undisturbed is None or logprobs == undisturbed
        assert ray_stats(cluster)["resumed"] >= 1
        assert_pools_whole(cluster)
        recoveries = asyncio.run(cluster.router_stats())["recoveries"]
        assert recoveries["count"] == 1 and all(seconds >= 0 for seconds in recoveries.values())
        parts = sum(recoveries[phase] for phase in ("restart", "model_load", "init_rest", "warm_up", "rejoin"))
        assert recoveries["model_load"] > 0 and parts <= recoveries["total"] + 0.5, recoveries  # 0.5 s: two clocks
    finally:
        cluster.stop()


def test_a_router_that_dies_restarts_and_readiness_follows_the_routers(checkpoint: Path) -> None:
    """Router replicas restart like workers (a killed one comes back, and requests sent to it do not
    fail); one gone for good takes no requests, and with none left the service is not ready and says
    why."""
    import ray

    from cluster.common.errors import ServiceUnavailable
    from cluster.serving.cluster_service import ClusterService

    engine_config = engine_config_for(checkpoint)
    expected = alone(engine_config, PROMPTS, GREEDY)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, routers=2)
    cluster = Cluster(config).start()
    service = ClusterService(cluster)

    async def tokens_of_all() -> list[list[int]]:
        async def one(index: int, prompt: list[int]) -> list[int]:
            return [t async for event in cluster.generate(prompt, GREEDY, request_id=f"rr-{index}-{time.monotonic()}")
                    for t in event.token_ids]

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS * 2))))

    async def until(condition: Any, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "the condition never held"
            await asyncio.sleep(0.05)

    async def main() -> None:
        watch = asyncio.create_task(cluster.watch_routers(every_s=0.2))
        try:
            ray.kill(cluster.routers[0], no_restart=False)  # a crash: Ray starts it again
            assert await tokens_of_all() == expected * 2  # meanwhile through router 1
            await until(lambda: not cluster.routers_down)
            assert ray.get(cluster.routers[0].stats.remote(), timeout=30) is not None  # restarted, answering
            assert await tokens_of_all() == expected * 2
            ray.kill(cluster.routers[0], no_restart=True)  # gone for good
            await until(lambda: 0 in cluster.routers_down)
            assert service.ready and "router 0" in service.problem
            assert await tokens_of_all() == expected * 2  # all through router 1
            ray.kill(cluster.routers[1], no_restart=True)
            await until(lambda: len(cluster.routers_down) == 2)
            assert not service.ready
            with pytest.raises(ServiceUnavailable, match="no router answers"):
                await tokens_of_all()
        finally:
            watch.cancel()

    try:
        asyncio.run(main())
    finally:
        cluster.stop()


def hand_opened_channels(actor: Any) -> int:
    """How many channels the test opened by hand run on the actor (a channel makes its outbox on start)."""
    return sum(caller.startswith("by-hand") for caller in actor.__dict__.get("_outboxes", {}))


def test_aborts_and_load_polls_never_wait_behind_streams(checkpoint: Path) -> None:
    """A worker runs at most `max_concurrency` calls at once, streams included (Ray's default 1,000);
    past that, calls queue. A router's requests hold one of them together (their channel,
    `cluster.ray_cluster.channels`), however many stream. Aborts and load polls run in a group of their
    own: with the decode worker's every slot held by a stream (3 here: the router's channel with two
    requests on it, and two more channels opened by hand), a plain call waits, a control call is
    answered and an abort ends the requests."""
    import ray
    from ray.exceptions import GetTimeoutError

    from cluster.ray_cluster.router import control

    engine_config = engine_config_for(checkpoint, num_blocks=512)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1),
                           decode=PoolConfig(replicas=1, num_cpus=0.1, max_concurrency=3), engine=engine_config)
    cluster = Cluster(config).start()
    decode = cluster.decode[0]
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)  # 60 s of paced steps
    received: dict[str, list[str | None]] = {"a": [], "b": []}

    async def one(name: str) -> None:
        async for event in cluster.generate(PROMPTS[0], params, request_id=name):
            received[name].append(event.finish_reason)

    async def main() -> None:
        tasks = [asyncio.create_task(one(name)) for name in received]
        deadline = time.monotonic() + 60
        while min(len(events) for events in received.values()) < 2:
            assert time.monotonic() < deadline and not any(task.done() for task in tasks)
            await asyncio.sleep(0.05)
        # Both requests stream on one slot: a plain call is still answered...
        assert await asyncio.to_thread(ray.get, decode.info.remote(), timeout=10)
        idle = [decode.channel.options(num_returns="streaming").remote(f"by-hand-{n}") for n in range(2)]
        # An async actor may start calls out of order: wait (through the control group) until both
        # channels run, or the plain call below could take a slot before the second one does.
        deadline = time.monotonic() + 30
        while await control(decode.__ray_call__).remote(hand_opened_channels) < 2:
            assert time.monotonic() < deadline, "the channels opened by hand never started"
            await asyncio.sleep(0.05)
        with pytest.raises(GetTimeoutError):  # ...until every slot is a stream's: it waits its turn
            await asyncio.to_thread(ray.get, decode.info.remote(), timeout=2)
        load = await asyncio.wait_for(control(decode.load).remote(), 10)
        assert load.num_running == 2
        await asyncio.wait_for(asyncio.gather(*(cluster.abort(name) for name in received)), 10)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        for channel in idle:
            ray.cancel(channel)

    try:
        ray.get(decode.__ray_call__.remote(pace_steps(LONG_STEP_S)), timeout=30)
        asyncio.run(main())
        assert [events[-1] for events in received.values()] == ["abort", "abort"]
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


def test_a_burst_past_the_prefill_pools_throughput_is_refused_early_not_recomputed(checkpoint: Path) -> None:
    """10 prompts at once on a prefill worker that computes about 80 tokens a second (paced steps of
    8 tokens), with 1 s of queue allowed and 3 s leases. Admitted all, they would queue for about 5 s,
    past their leases, and the decode worker would compute them again when it is busiest. The ones past
    a second of queue are refused at once (QueueFullError: a 429), the admitted ones finish with the
    engine's tokens, nothing is recomputed, nothing leaks."""
    import random

    import ray

    engine_config = fp32_engine(checkpoint, block_size=4, num_blocks=512, max_num_batched_tokens=8)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, kv_lease_s=3.0, max_prefill_wait_s=1.0)
    generator = random.Random(7)
    prompts = [[generator.randrange(3, 300) for _ in range(40)] for _ in range(11)]  # 5 paced steps each
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = alone(engine_config, prompts, params)
    cluster = Cluster(config).start()

    try:
        ray.get(cluster.prefill[0].__ray_call__.remote(pace_steps(0.1)), timeout=30)
        assert burst(cluster, prompts, params, range(1)) == expected[:1]  # measures the prefill worker's throughput
        deadline = time.monotonic() + 30
        while not ray.get(cluster.router.__ray_call__.remote(
                lambda router: any(load.tokens_per_s for load in router.loads.values())), timeout=30):
            assert time.monotonic() < deadline, "the router never learnt the prefill throughput"
            time.sleep(0.2)
        answers = burst(cluster, prompts, params, range(1, 11))
        refused = [answer for answer in answers if isinstance(answer, str)]
        served = [(index, answer) for index, answer in enumerate(answers, 1) if not isinstance(answer, str)]
        assert refused and served, answers
        assert all("overloaded" in reason for reason in refused)
        assert all(answer == expected[index] for index, answer in served)
        assert ray.get(cluster.decode[0].load.remote(), timeout=30).kv_recomputes == 0
        assert ray_stats(cluster)["refused_overloaded"] == len(refused)
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


def cuda_config(checkpoint: Path, device: str = "cuda", **pool: Any) -> ClusterConfig:
    engine = engine_config_for(checkpoint)
    return ClusterConfig(engine=replace(engine, model=replace(engine.model, device=device)),
                         prefill=PoolConfig(**pool), decode=PoolConfig(**pool))


def test_gpus_per_worker_follow_the_device(checkpoint: Path) -> None:
    import ray

    has_gpus = bool(ray.cluster_resources().get("GPU", 0))
    assert Cluster(cuda_config(checkpoint)).gpus_per_worker(PoolConfig()) == 1  # one worker per GPU
    assert Cluster(cuda_config(checkpoint, "cpu")).gpus_per_worker(PoolConfig()) == 0
    assert Cluster(cuda_config(checkpoint, "auto")).gpus_per_worker(PoolConfig()) == (1 if has_gpus else 0)
    assert Cluster(cuda_config(checkpoint)).gpus_per_worker(PoolConfig(num_gpus=0.5)) == 0.5  # sharing, asked for


def test_cuda_workers_on_an_embedded_ray_without_gpus_are_refused_at_start(checkpoint: Path) -> None:
    import ray

    if ray.cluster_resources().get("GPU", 0):
        pytest.skip("this Ray has GPUs")
    with pytest.raises(ValueError, match=r"the workers ask Ray for GPUs \[1, 1\] and Ray's nodes have \[0\] GPU"):
        Cluster(cuda_config(checkpoint)).start()


@pytest.mark.usefixtures("ray_session")
def test_the_embedded_ray_admits_only_holders_of_its_token() -> None:
    """The embedded Ray's ports listen on every interface, and joining it means running code on it:
    it runs with Ray's token authentication and a token only this process and its children hold.
    Another process at the same address, with no token or a wrong one, is refused. One given the
    token joins: what `--ray-address` users do with their cluster's token."""
    import os
    import subprocess
    import sys

    import ray

    address = ray.get_runtime_context().gcs_address
    join = f"import ray; ray.init(address={address!r}, log_to_driver=False); print('joined', flush=True)"
    own = {key: value for key, value in os.environ.items() if not key.startswith("RAY_AUTH")}
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64
    tries = {"none": {"RAY_AUTH_MODE": "disabled"}, "wrong": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
             "holder": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"]}}
    processes = {name: subprocess.Popen([sys.executable, "-c", join], env={**own, **extra}, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                 for name, extra in tries.items()}  # at once: a refused one takes its connect timeout
    outcomes = {name: "joined" in process.communicate(timeout=120)[0] for name, process in processes.items()}
    assert outcomes == {"none": False, "wrong": False, "holder": True}


def test_a_lease_that_ends_while_the_prefill_computes_goes_on_after_the_token_the_client_has(checkpoint: Path) -> None:
    """Leases of 1 s, a prefill worker taking longer (paced steps): every reservation ends before its
    KV comes, and each prefill still streams its first token to the client. The decode workers
    recompute the prompts and go on after those tokens (the router tells them), not after first
    tokens of their own: with unseeded sampling those would differ, the router would see the restated
    token differ and refuse the splice."""
    import ray

    engine_config = fp32_engine(checkpoint, block_size=4, num_blocks=256, max_num_batched_tokens=8)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, kv_lease_s=1.0, max_prefill_wait_s=0)
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)  # no seed
    cluster = Cluster(config).start()

    async def one(index: int) -> list[int]:
        prompt = [3 + 7 * index + offset for offset in range(6)]
        return [t async for event in cluster.generate(prompt, params, request_id=f"late-{index}")
                for t in event.token_ids]

    async def together() -> list[list[int]]:
        return list(await asyncio.gather(*(one(index) for index in range(3))))

    try:
        ray.get(cluster.prefill[0].__ray_call__.remote(pace_steps(1.2)), timeout=30)
        answers = asyncio.run(together())
        assert [len(answer) for answer in answers] == [6, 6, 6]
        assert ray.get(cluster.decode[0].load.remote(), timeout=30).kv_recomputes == 3  # every lease ended
        assert ray_stats(cluster)["splice_refused"] == 0
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


def test_the_first_burst_after_start_is_admitted_by_the_warm_up_throughput(checkpoint: Path) -> None:
    """No request has run yet: the prefill worker's rate comes from its warm-up (a timed prefill), and
    the router asks for it before admitting its first request, so the very first burst is sized by
    the wait it would face, not admitted whole for want of a rate. A tiny allowed queue (1 ms of
    prompts) makes any rate a machine reaches refuse most of 10 prompts."""
    import ray

    engine_config = fp32_engine(checkpoint, block_size=4, num_blocks=512)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, max_prefill_wait_s=0.001)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    prompts = [[3 + index + offset for offset in range(40)] for index in range(10)]
    cluster = Cluster(config).start()

    try:
        assert ray.get(cluster.prefill[0].load.remote(), timeout=30).tokens_per_s > 0  # measured at warm-up
        answers = ["refused" if isinstance(answer, str) else "served"
                   for answer in burst(cluster, prompts, params, range(10))]
        assert "served" in answers and "refused" in answers, answers
        assert ray_stats(cluster)["refused_overloaded"] == answers.count("refused")
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


def test_a_named_clusters_workers_outlive_it_and_the_next_takes_them_over(checkpoint: Path) -> None:
    """With a name the workers are detached: a cluster (a gateway) that stops leaves them running, the
    next one of that name takes them over (same processes, models not loaded again) and serves; one
    with fewer workers stops the surplus; one with another engine config makes its workers again;
    `stop(workers=True)` ends them. (tests/deploy/test_gateway_restart.py kills a real gateway.)"""
    import ray

    from cluster.ray_cluster.launcher import named_workers

    address = ray.get_runtime_context().gcs_address
    engine_config = engine_config_for(checkpoint)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.05), decode=PoolConfig(replicas=2, num_cpus=0.05),
                           engine=engine_config, ray_address=address, name="keep-me")
    expected = alone(engine_config, PROMPTS[:2], GREEDY)
    first = Cluster(config).start()
    try:
        assert generate_all(first, PROMPTS[:2], GREEDY) == expected
        started = {load.worker_id: load.started_at for load in asyncio.run(first.workers())}
        first.stop()  # the gateway goes; its workers stay
        assert named_workers("keep-me") == ["pdserve-keep-me-decode-0", "pdserve-keep-me-decode-1",
                                            "pdserve-keep-me-prefill-0"]
        changed = replace(config, decode=PoolConfig(replicas=1, num_cpus=0.06))  # one worker less, on other CPUs
        second = Cluster(changed).start()
        assert sorted(second.taken_over) == ["pdserve-keep-me-prefill-0"]  # decode's pool changed: made again
        assert named_workers("keep-me") == ["pdserve-keep-me-decode-0", "pdserve-keep-me-prefill-0"]  # surplus gone
        assert generate_all(second, PROMPTS[:2], GREEDY) == expected
        now = {load.worker_id: load.started_at for load in asyncio.run(second.workers())}
        assert now["prefill-0"] == started["prefill-0"] and now["decode-0"] > started["decode-0"]
        second.stop()
        third = Cluster(changed).start()
        assert sorted(third.taken_over) == ["pdserve-keep-me-decode-0", "pdserve-keep-me-prefill-0"]
        assert {load.worker_id: load.started_at for load in asyncio.run(third.workers())} == now  # not reloaded
        assert generate_all(third, PROMPTS[:2], GREEDY) == expected
        assert_pools_whole(third)
        third.stop(workers=True)
    finally:
        first.stop(workers=True)
        from cluster.ray_cluster.launcher import stop_worker

        for name in named_workers("keep-me"):
            stop_worker(name)
    assert named_workers("keep-me") == []


def test_a_resumed_request_that_finds_no_room_waits_for_some(checkpoint: Path) -> None:
    """A stream's decode worker is killed while the other decode worker is full (a reservation holds
    every free block). The resumed request is not refused (its stream has begun: that would end it
    with an error): it waits for room (the hold's lease ends, or the killed worker comes back) and
    finishes with the tokens of an undisturbed run."""
    import ray

    engine_config = engine_config_for(checkpoint, num_blocks=64)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    (expected,) = alone(engine_config, PROMPTS[:1], params)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=2, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()
    received: list[int] = []

    async def stream() -> None:
        async for event in cluster.generate(PROMPTS[0], params, request_id="resumed"):
            assert event.index == len(received)  # in order, nothing repeated
            received.extend(event.token_ids)

    async def scenario() -> None:
        task = asyncio.create_task(stream())
        while len(received) < 10:
            assert not task.done(), "the stream ended early"
            await asyncio.sleep(0.005)
        loads = [await worker.load.remote() for worker in cluster.decode]
        serving = next(i for i, load in enumerate(loads) if load.num_running)
        other = cluster.decode[1 - serving]
        hold = [7] * (loads[1 - serving].num_free_blocks * 4 - 1)  # every free block of the other worker
        assert await other.reserve.remote("hold", hold, GREEDY, 3.0) is not None
        ray.kill(cluster.decode[serving], no_restart=False)
        await asyncio.wait_for(task, 120)
        await other.abort.remote("hold")

    try:
        for worker in cluster.decode:
            ray.get(worker.__ray_call__.remote(pace_steps(0.05)), timeout=30)
        asyncio.run(scenario())
        assert received == expected
        assert ray_stats(cluster)["resumed"] == 1
        assert_pools_whole(cluster)
    finally:
        cluster.stop()


def _rss_bytes(actor: Any) -> int:
    """For `__ray_call__`: the resident memory of the actor's process."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_10x_burst_on_the_decode_pool_is_refused_early_and_nothing_grows(checkpoint: Path) -> None:
    """A decode worker with 2 running slots, its requests measured at about a second each, 1 s of
    queue allowed: a burst of 20 at once (10x its slots). Refusing only when its KV memory ran out,
    the pool would queue them for up to 10 s; those past the allowed wait are refused at once (429),
    the admitted ones finish with the engine's tokens, every pool is whole after, and no worker's
    memory grew by more than 64 MiB."""
    import ray

    engine_config = fp32_engine(checkpoint, block_size=4, num_blocks=512, max_num_seqs=2)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config, max_prefill_wait_s=0, max_decode_wait_s=1.0)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [[3 + index + offset for offset in range(12)] for index in range(20)]
    expected = alone(engine_config, prompts, params)
    cluster = Cluster(config).start()

    workers = cluster.prefill + cluster.decode
    try:
        ray.get(cluster.decode[0].__ray_call__.remote(pace_steps(0.05)), timeout=30)
        assert burst(cluster, prompts, params, range(2)) == expected[:2]  # measures a request's running time
        deadline = time.monotonic() + 30
        while not ray.get(cluster.router.__ray_call__.remote(
                lambda router: any(load.seconds_per_request for load in router.loads.values()
                                   if load.role == "decode")), timeout=30):  # the prefill worker's is no help
            assert time.monotonic() < deadline, "the router never learnt the decode worker's request time"
            time.sleep(0.2)
        memory = ray.get([worker.__ray_call__.remote(_rss_bytes) for worker in workers], timeout=30)
        answers = burst(cluster, prompts, params, range(20))
        refused = [answer for answer in answers if isinstance(answer, str)]
        served = [(index, answer) for index, answer in enumerate(answers) if not isinstance(answer, str)]
        assert len(refused) >= 10 and served, answers
        assert all("decode workers have" in reason and "overloaded" in reason for reason in refused)
        assert all(answer == expected[index] for index, answer in served)
        assert_pools_whole(cluster)
        after = ray.get([worker.__ray_call__.remote(_rss_bytes) for worker in workers], timeout=30)
        grown = [now - before for before, now in zip(memory, after, strict=True)]
        assert max(grown) < 64 << 20, grown
    finally:
        cluster.stop()


def _die_after_the_last_event(actor: Any) -> None:
    """For `__ray_call__`: the worker's process ends right after a request's last event went out."""
    import asyncio
    import os

    outputs = actor.worker._outputs

    async def dying(request_id: str) -> Any:
        async for item in outputs(request_id):
            yield item
            if item.finished:
                await asyncio.sleep(0.2)  # the event reaches the router, the stream has not ended
                os._exit(1)

    actor.worker._outputs = dying


def test_a_decode_worker_that_dies_after_the_last_event_ends_the_request_once(checkpoint: Path) -> None:
    """The decode worker's process dies between a request's last event and the end of its stream.
    The request is whole: one finish, no resume elsewhere (which would send the client a second
    finish chunk)."""
    import ray

    engine_config = engine_config_for(checkpoint)
    (expected,) = alone(engine_config, PROMPTS[:1], GREEDY)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=2, num_cpus=0.1),
                           engine=engine_config)
    cluster = Cluster(config).start()

    async def events() -> list[Any]:
        return [event async for event in cluster.generate(PROMPTS[0], GREEDY, request_id="last")]

    try:
        ray.get([worker.__ray_call__.remote(_die_after_the_last_event) for worker in cluster.decode], timeout=30)
        got = asyncio.run(events())
        assert [event.finished for event in got].count(True) == 1 and got[-1].finished
        assert [t for event in got for t in event.token_ids] == expected
        assert ray_stats(cluster)["resumed"] == 0
    finally:
        cluster.stop()


def _die_when_kv_lands(actor: Any) -> None:
    """For `__ray_call__`: the worker's process ends as the next KV lands, before it admits the request."""
    import os

    def die(*_: Any) -> None:
        os._exit(1)

    actor.worker.engine.import_kv = die


def test_a_decode_worker_lost_after_the_prefill_streamed_the_first_token_is_resumed_after_it(checkpoint: Path) -> None:
    """The prefill worker streamed the first token, then the decode worker died before admitting the
    request. The request is resumed after the token the client has, not sent to the other decode
    worker with a new prefill, whose new first token (unseeded sampling: another one) the client would
    never see: the answer would go on after a token it did not have (a splice, which the router
    refuses). The prompt's logprobs came with that token: the resumed run (whose prompt is the prompt
    and that token) sends none."""
    import ray

    engine_config = engine_config_for(checkpoint)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=2, num_cpus=0.1),
                           engine=engine_config)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, prompt_logprobs=1)  # no seed
    cluster = Cluster(config).start()

    async def events() -> list[TokenEvent]:
        return [event async for event in cluster.generate(PROMPTS[0], params, request_id="cut")]

    try:
        ray.get(cluster.decode[0].__ray_call__.remote(_die_when_kv_lands), timeout=30)
        received = asyncio.run(events())
        assert sum(len(event.token_ids) for event in received) == 8
        prompt_logprobs = [event.prompt_logprobs for event in received if event.prompt_logprobs is not None]
        assert [len(entries) for entries in prompt_logprobs] == [len(PROMPTS[0])]  # once, the prompt's own
        stats = ray_stats(cluster)
        assert stats["resumed"] == 1 and stats["splice_refused"] == 0, stats
    finally:
        cluster.stop()


def test_a_request_aborted_while_it_waits_to_be_resumed_is_not_run_again(checkpoint: Path) -> None:
    """The only decode worker dies mid-stream; while the request waits for it to restart, its client
    leaves (the front door stops reading and aborts, as the gateway does). The abort reaches the
    request, not only its dead run: the resumed run is not started (for nobody, it would be held at
    its backpressure limit for good, its router entries and worker stream with it), and the abandoned
    stream is cancelled: every router entry, worker stream and block comes back."""
    import ray

    engine_config = engine_config_for(checkpoint, num_blocks=256)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine_config)
    params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    cluster = Cluster(config).start()

    async def leave_while_resuming() -> None:
        stream = cluster.generate(PROMPTS[0], params, request_id="left")
        for _ in range(3):
            await anext(stream)
        ray.kill(cluster.decode[0], no_restart=False)  # a crash: Ray starts it again
        await asyncio.sleep(0.5)  # the router finds the run lost and waits for a decode worker
        await stream.aclose()
        await cluster.abort("left")

    try:
        ray.get(cluster.decode[0].__ray_call__.remote(pace_steps(0.02)), timeout=30)
        asyncio.run(leave_while_resuming())
        # Gone and back in the router's eyes: right after the abort it may not have noticed the death yet,
        # and a wait for "decode-0 listed" then passed at once, while Ray was still restarting the worker.
        wait_until_rejoined(cluster, 1)
        time.sleep(2.0)  # a resumed run, were one started, would be held by now
        assert_pools_whole(cluster)  # router entries included
        assert ray.get(cluster.decode[0].__ray_call__.remote(lambda actor: list(actor.worker.streams)),
                       timeout=30) == []
    finally:
        cluster.stop()
