"""Decode-side prefix reuse on the cluster path (1 prefill + 2 decode workers on Ray): a conversation's
next turn goes to the decode worker that served its last one, which keeps the blocks it holds; the
prefill worker sends only the blocks after them, and a turn whose uncached rest is shorter than
`local_prefill_threshold` is computed on the decode worker with no prefill worker involved. Tokens
are the engine alone's, nothing is recomputed, and every pool is whole at the end. Routed by the
router's own record of where it sent each prompt, and by the blocks the workers publish to Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.serving.process import gateway_metrics
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_engine
from tests.observability.scrape import samples, value
from tests.ray_cluster.conftest import wait_for
from tests.ray_cluster.test_ray_cluster import assert_pools_whole

pytestmark = pytest.mark.usefixtures("ray_session")
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
FIRST_TURNS = {"a": list(range(10, 51)), "b": list(range(100, 141))}  # 41 tokens each: 11 blocks of 4
SECOND_USER_TOKENS = 20  # a long new message: prefilled on the prefill worker, only its blocks sent
THIRD_USER_TOKENS = 3  # a short one: computed on the decode worker
THRESHOLD = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


async def turn(cluster: Cluster, prompt: list[int], request_id: str) -> tuple[list[int], str]:
    """One request through the cluster: its tokens and the worker that sent its last event."""
    tokens, worker = [], ""
    async for event in cluster.generate(prompt, PARAMS, request_id=request_id):
        assert event.index == len(tokens)
        tokens += event.token_ids
        worker = event.worker_id
    return tokens, worker


def first_turns(cluster: Cluster) -> dict[str, tuple[list[int], str]]:
    """Both conversations' first turns at once: the router spreads them over the two decode workers."""

    async def both() -> list[tuple[list[int], str]]:
        return list(await asyncio.gather(*(turn(cluster, prompt, f"{name}-1") for name, prompt in FIRST_TURNS.items())))

    return dict(zip(FIRST_TURNS, asyncio.run(both()), strict=True))


def loads_of(cluster: Cluster) -> list[WorkerLoad]:
    return asyncio.run(cluster.workers())


def wait_until_published(redis_url: str, cluster: Cluster, history: list[int], worker: str) -> None:
    """Workers publish their caches every PUBLISH_S: wait until the index says `worker` holds the history."""
    from cluster.common.block_hashes import prefix_hashes
    from cluster.state.connect import connect_state

    async def held() -> int:
        state = connect_state(redis_url)
        try:
            hashes = prefix_hashes(history, 4, cluster.model_name)
            return (await state.match(hashes, [worker])).get(worker, 0)
        finally:
            await state.close()

    wait_for(lambda: asyncio.run(held()) >= (len(history) - 1) // 4, f"{worker} never published the history")


@pytest.mark.parametrize("index", ["router", "redis"])
def test_a_conversations_later_turns_ship_only_their_new_blocks_or_none(checkpoint: Path, index: str,
                                                                         request: pytest.FixtureRequest) -> None:
    redis_url = request.getfixturevalue("dedicated_redis").url if index == "redis" else ""
    engine = fp32_engine(checkpoint, block_size=4, num_blocks=256)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=2, num_cpus=0.1),
                           engine=engine, local_prefill_threshold=THRESHOLD, redis_url=redis_url)
    alone = LLMEngine(engine)  # the oracle: one engine, the turns in the same order
    cluster = Cluster(config).start()
    try:
        histories, served_by = {}, {}
        for name, (tokens, worker) in first_turns(cluster).items():
            assert tokens == alone.generate([FIRST_TURNS[name]], PARAMS)[0].token_ids, name
            histories[name], served_by[name] = FIRST_TURNS[name] + tokens, worker
        assert served_by["a"] != served_by["b"]
        # One at a time from here: by load alone both would go to the same (first) decode worker.
        for number, new_tokens in ((2, list(range(200, 200 + SECOND_USER_TOKENS))),
                                   (3, list(range(250, 250 + THIRD_USER_TOKENS)))):
            for name in histories:
                if redis_url:  # routed by what the decode worker published of its cache
                    wait_until_published(redis_url, cluster, histories[name], served_by[name])
                prompt = histories[name] + new_tokens
                tokens, worker = asyncio.run(turn(cluster, prompt, f"{name}-{number}"))
                assert tokens == alone.generate([prompt], PARAMS)[0].token_ids, (name, number)
                assert worker == served_by[name], (name, number)  # where its history is
                histories[name] = prompt + tokens
        loads = loads_of(cluster)
        prefill = next(load for load in loads if load.role == "prefill")
        decode = [load for load in loads if load.role == "decode"]
        # Each conversation: turn 1 sends its 11 blocks. Turn 2 (41 + 8 + 20 = 69 tokens, 18 blocks) finds
        # the 12 full blocks of the 48 tokens the decode worker computed in turn 1, and 6 are sent.
        # Turn 3 (69 + 8 + 3 = 80 tokens) finds 19 blocks (76 tokens): 4 left, under the threshold of 8,
        # computed on the decode worker. Without reuse: 11 + 18 + 20 blocks each.
        assert prefill.kv_transfer_blocks == 2 * (11 + 6)
        assert prefill.kv_transfers == 4  # turn 3 asked no prefill worker
        assert sum(load.local_prefills for load in decode) == 2
        assert sum(load.decode_reused_prompt_tokens for load in decode) == 2 * (48 + 76)
        assert not prefill.kv_transfer_failures and not any(load.kv_recomputes for load in decode)
        scraped = samples(asyncio.run(gateway_metrics("tiny", config).exposition(loads)).decode())
        assert value(scraped, "pdserve:kv_transfer_blocks_total", role="prefill") == 34
        assert value(scraped, "pdserve:local_prefills_total", role="decode") == 2
        assert_pools_whole(cluster)
    finally:
        cluster.stop()
