"""Decode-side prefix reuse between a prefill and a decode worker (engine threads, loopback KV): the
prefill worker sends, chunk by chunk as it computes, only the blocks after those the decode worker
holds, numbered from there; a short uncached rest is computed on the decode worker. Tokens equal the
engine alone's and every block comes back, also when a request ends mid-transfer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.common.loads import PrefixReuse, TransferStats
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.worker import Worker
from tests.engine.test_engine_outputs import GREEDY
from tests.worker.test_worker_disaggregated import assert_whole, make_engine, running_pair

FIRST_TURN = list(range(200, 241))  # 41 tokens: 11 blocks of 4
REUSE = PrefixReuse(enabled=True, local_prefill_threshold=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


async def serve(prefill: Worker, decode: Worker, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """The router's part of one turn, reusing the decode worker's cache: its tokens and the blocks sent."""
    ticket = await decode.reserve(request_id, prompt, GREEDY, reuse=REUSE)
    assert ticket is not None
    tokens: list[int] = []
    sent = 0
    if not ticket.local:
        async for item in prefill.prefill(request_id, prompt, GREEDY, ticket):
            if isinstance(item, TransferStats):
                sent = item.nbytes
            else:
                tokens += item.new_token_ids
    async for output in decode.stream(request_id, tokens[0] if tokens else None):
        tokens += output.token_ids[len(tokens):]
    block_bytes = decode.engine.runner.read_blocks([0]).nbytes
    return tokens, sent // block_bytes


def test_turns_ship_only_their_new_blocks_in_chunks_and_a_short_one_none(checkpoint: Path) -> None:
    alone = make_engine(checkpoint)

    async def conversation() -> None:
        async with running_pair(checkpoint) as (prefill, decode, _):
            history, shipped = FIRST_TURN, []
            for number, new in enumerate([[], list(range(300, 320)), [9, 10, 11]]):
                prompt = history + new
                tokens, blocks = await serve(prefill, decode, f"turn-{number}", prompt)
                assert tokens == alone.generate([prompt], GREEDY)[0].token_ids, number
                shipped.append(blocks)
                history = prompt + tokens
            # 11 blocks; then 85 tokens (22 blocks) after 64 computed (16 held); then 112 tokens of which
            # 108 computed in turn 2 (27 blocks held): 4 left, under 8, computed on the decode worker.
            assert shipped == [11, 22 - 16, 0]
            assert prefill.transfer_blocks == 17 and prefill.frame_count > 3  # in chunks (a budget of 6)
            load = await decode.load()
            assert (load.local_prefills, load.decode_reused_prompt_tokens, load.kv_recomputes) == (1, 64 + 108, 0)
            assert not prefill.transfer_failures
            await asyncio.sleep(0.1)
            assert_whole(prefill, decode)

    asyncio.run(conversation())


def test_a_turn_aborted_mid_transfer_on_reused_blocks_gives_every_block_back(checkpoint: Path) -> None:
    async def aborted() -> None:
        async with running_pair(checkpoint, make_engine(checkpoint, budget=4)) as (prefill, decode, _):
            tokens, _ = await serve(prefill, decode, "turn-1", FIRST_TURN)
            prompt = FIRST_TURN + tokens + list(range(100, 140))
            ticket = await decode.reserve("turn-2", prompt, GREEDY, reuse=REUSE)
            assert ticket is not None and ticket.reused_blocks == 16
            frames = prefill.frame_count
            async for _ in prefill.prefill("turn-2", prompt, GREEDY, ticket):
                break  # the first token: the rest of the KV is still on its way
            await decode.abort("turn-2")
            await prefill.abort("turn-2")
            await asyncio.sleep(0.3)
            assert prefill.frame_count >= frames
            assert_whole(prefill, decode)

    asyncio.run(aborted())
