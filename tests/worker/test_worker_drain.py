"""Draining a worker (the live controller removes it): no new requests, those it holds finish, it
leaves the registry, and its blocks all come back; or, past its timeout, it says it still holds some."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.state.in_process import InProcessState
from cluster.state.interface import WorkerInfo
from cluster.transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.worker import Worker
from tests.engine.test_engine_outputs import PROMPTS
from tests.worker.test_worker_disaggregated import assert_whole, make_engine, serve

LONG = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
WITHIN_S = 60  # a drain that never ends fails the test instead of hanging it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


async def settle(tasks: list[asyncio.Task[Any]], *workers: Worker) -> None:
    """Cancel what still runs while the engines do (a cancelled stream frees its request on the engine
    thread), then stop the workers: a failed check ends the test instead of hanging it."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for worker in workers:
        await worker.stop()


async def until(condition: Callable[[], bool], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.005)


def test_a_draining_decode_worker_takes_nothing_new_and_finishes_what_it_holds(checkpoint: Path) -> None:
    expected = [make_engine(checkpoint).generate([prompt], LONG)[0].token_ids for prompt in PROMPTS]

    async def main() -> None:
        hub, state = LoopbackHub(), InProcessState()
        prefill = Worker("prefill-0", "prefill", make_engine(checkpoint), sender=LoopbackSender(hub))
        decode = Worker("decode-0", "decode", make_engine(checkpoint), receiver=LoopbackReceiver(hub, "decode-0"),
                        state=state, listing=WorkerInfo("decode-0", "decode", "decode-0"))
        await prefill.start()
        await decode.start()
        held: list[asyncio.Task[Any]] = []
        try:
            while not await state.workers():  # it lists itself as it starts serving
                await asyncio.sleep(0.005)
            assert [info.worker_id for info in await state.workers()] == ["decode-0"]
            held += [asyncio.create_task(serve(prefill, decode, f"r{i}", p, LONG)) for i, p in enumerate(PROMPTS)]
            await until(lambda: len(decode.streams) == len(PROMPTS) or any(task.done() for task in held))
            assert not any(task.done() for task in held)  # all three reserved here and none ended yet
            draining = asyncio.create_task(decode.drain(timeout_s=60))
            held.append(draining)
            await until(lambda: decode.draining)
            assert await decode.reserve("new", PROMPTS[0], LONG) is None  # the router asks the next worker
            assert (await decode.load()).draining and await state.workers() == []
            assert not draining.done()
            assert await draining is True
            assert [await task for task in held[:-1]] == expected  # every token of what it held
            assert_whole(decode)
        finally:
            await settle(held, prefill, decode)

    asyncio.run(asyncio.wait_for(main(), WITHIN_S))


def test_a_drain_past_its_timeout_says_the_worker_still_holds_requests(checkpoint: Path) -> None:
    async def main() -> None:
        hub = LoopbackHub()
        prefill = Worker("prefill-0", "prefill", make_engine(checkpoint), sender=LoopbackSender(hub))
        decode = Worker("decode-0", "decode", make_engine(checkpoint), receiver=LoopbackReceiver(hub, "decode-0"))
        await prefill.start()
        await decode.start()
        held = asyncio.create_task(serve(prefill, decode, "r0", PROMPTS[2],
                                         SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)))
        try:
            await until(lambda: bool(decode.streams))
            assert await decode.drain(timeout_s=0.05) is False
        finally:
            await settle([held], prefill, decode)

    asyncio.run(asyncio.wait_for(main(), WITHIN_S))
