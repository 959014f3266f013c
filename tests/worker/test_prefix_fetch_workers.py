"""A prefill worker fetches the beginning of a prompt's KV from a peer worker that caches it (another
prefill worker, or the decode worker holding a conversation), over the KV transfer, instead of
computing it. Engine threads and loopback KV, the router's part played by the test. Tokens equal the
engine alone's; a failed or expired fetch costs the prefix's compute, never a token; every block
comes back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cluster.transfer.connector import TransferError
from cluster.transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.worker import Worker
from tests.engine.test_engine_outputs import GREEDY
from tests.worker.test_worker_disaggregated import assert_whole, make_engine, serve

DOCUMENT = list(range(100, 141))  # 41 tokens: ten full blocks of 4 and one token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


@contextlib.asynccontextmanager
async def running_trio(path: Path) -> AsyncIterator[tuple[Worker, Worker, Worker, LoopbackHub]]:
    """Two prefill workers and a decode worker, each able to send and receive (as with fetching on)."""
    hub = LoopbackHub()
    workers = [Worker(name, role, make_engine(path, budget=8), sender=LoopbackSender(hub),
                      receiver=LoopbackReceiver(hub, name))
               for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"))]
    for worker in workers:
        await worker.start()
    try:
        yield workers[0], workers[1], workers[2], hub
    finally:
        for worker in workers:
            await worker.stop()


async def fetch(donor: Worker, fetcher: Worker, fetch_id: str, prompt: list[int]) -> int:
    """The router's part of a fetch of every full block the donor holds: blocks sent."""
    offered = await donor.offer_prefix(fetch_id, prompt, "", 0, len(prompt) // 4)
    ticket = await fetcher.expect_prefix(fetch_id, prompt, "", 0, offered) if offered else None
    if ticket is None:
        await donor.release_prefix(fetch_id)
        return 0
    try:
        await donor.send_prefix(fetch_id, ticket)
    except TransferError:
        await fetcher.release_prefix(fetch_id)
        raise
    return offered


async def prefill_after_fetch(fetcher: Worker, decode: Worker, request_id: str, prompt: list[int],
                              fetch_id: str) -> list[int]:
    """`serve`, with the prefill waiting for the fetched prefix."""
    ticket = await decode.reserve(request_id, prompt, GREEDY)
    assert ticket is not None
    tokens: list[int] = []
    async for item in fetcher.prefill(request_id, prompt, GREEDY, ticket, fetch_id=fetch_id):
        tokens += getattr(item, "new_token_ids", [])
    async for output in decode.stream(request_id, tokens[0]):
        tokens += output.token_ids[len(tokens):]
    return tokens


def test_a_prefix_fetched_from_a_prefill_peer_is_not_computed_again(checkpoint: Path) -> None:
    alone = make_engine(checkpoint)

    async def main() -> None:
        async with running_trio(checkpoint) as (donor, fetcher, decode, _):
            await serve(donor, decode, "first", DOCUMENT)
            prompt = DOCUMENT + [7, 8, 9, 10, 11]
            assert await fetch(donor, fetcher, "request:prefix", prompt) == 10
            tokens = await prefill_after_fetch(fetcher, decode, "request", prompt, "request:prefix")
            assert tokens == alone.generate([prompt], GREEDY)[0].token_ids
            load, donor_load = await fetcher.load(), await donor.load()
            assert load.prefix_cache_hits == 40 and load.prefix_blocks_fetched == 10
            assert donor_load.prefix_blocks_offered == 10
            await asyncio.sleep(0.1)
            assert_whole(donor, fetcher, decode)
            assert not fetcher.fetches and not fetcher.engine.prefix_pins.pins

    asyncio.run(main())


def test_a_conversation_held_by_its_decode_worker_is_fetched_with_its_reply(checkpoint: Path) -> None:
    alone = make_engine(checkpoint)

    async def main() -> None:
        async with running_trio(checkpoint) as (first, fetcher, decode, _):
            reply = await serve(first, decode, "turn-1", DOCUMENT)  # the fetcher holds nothing of it
            prompt = DOCUMENT + reply + [7, 8, 9]  # 68 tokens; the decode worker computed 64 of them
            assert await fetch(decode, fetcher, "turn-2:prefix", prompt) == 16
            tokens = await prefill_after_fetch(fetcher, decode, "turn-2", prompt, "turn-2:prefix")
            assert tokens == alone.generate([prompt], GREEDY)[0].token_ids
            assert (await fetcher.load()).prefix_cache_hits >= 64
            await asyncio.sleep(0.1)
            assert_whole(first, fetcher, decode)

    asyncio.run(main())


def test_a_failed_or_expired_fetch_costs_the_prefixs_compute_and_nothing_else(checkpoint: Path) -> None:
    alone = make_engine(checkpoint)

    async def main() -> None:
        async with running_trio(checkpoint) as (donor, fetcher, decode, hub):
            await serve(donor, decode, "first", DOCUMENT)
            prompt = DOCUMENT + [7, 8, 9, 10, 11]
            hub.fail_next(address=fetcher.receiver.address)
            with pytest.raises(TransferError):
                await fetch(donor, fetcher, "failed:prefix", prompt)
            tokens = await prefill_after_fetch(fetcher, decode, "failed", prompt, "failed:prefix")
            assert tokens == alone.generate([prompt], GREEDY)[0].token_ids
            assert (await fetcher.load()).prefix_blocks_fetched == 0
            # An offer whose lease ran out before the send: refused, its blocks unpinned.
            assert await donor.offer_prefix("late:prefix", prompt, "", 0, 10, lease_s=0.0) == 10
            ticket = await fetcher.expect_prefix("late:prefix", prompt, "", 0, 10)
            assert ticket is not None
            await asyncio.sleep(0.01)
            await donor.offer_prefix("other:prefix", prompt, "", 0, 10)  # ends the stale one
            with pytest.raises(TransferError, match="lease"):
                await donor.send_prefix("late:prefix", ticket)
            await donor.release_prefix("other:prefix")
            await fetcher.release_prefix("late:prefix")
            await asyncio.sleep(0.1)
            assert_whole(donor, fetcher, decode)
            assert not fetcher.engine.kv_cache.pool.cached.keys() - set(fetcher.engine._chain(prompt, "", 11))

    asyncio.run(main())
