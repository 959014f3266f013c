"""Prefill and decode workers (engine threads + loopback KV connector) serving requests together.

The driver here does what the router does: reserve on the decode worker, prefill on the prefill
worker (first token streamed at once, then the KV sent), then stream the rest from the decode side.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.common.loads import TransferStats
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.transfer.connector import KVHeader, TransferError, TransferState
from cluster.transfer.loopback import FailMode, FrameRefused, LoopbackHub, LoopbackReceiver, LoopbackSender, Refusal
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.worker import Worker
from tests.engine.test_engine_outputs import GREEDY, PROMPTS
from tests.helpers import fp32_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    engine = make_engine(checkpoint)
    return [engine.generate([prompt], GREEDY)[0].token_ids for prompt in PROMPTS]


def make_engine(path: Path, budget: int = 2048) -> LLMEngine:
    return LLMEngine(EngineConfig(model=fp32_model(path), cache=CacheConfig(block_size=4, num_blocks=128),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


async def serve(prefill: Worker, decode: Worker, request_id: str, prompt: list[int],
                params: SamplingParams = GREEDY) -> list[int]:
    """The router's part of one request: every token exactly once, in order."""
    address = await decode.reserve(request_id, prompt, params)
    assert address is not None
    tokens: list[int] = []
    try:
        async for item in prefill.prefill(request_id, prompt, params, address):
            if not isinstance(item, TransferStats):
                tokens += item.new_token_ids
    except TransferError:  # at once, rather than when the lease ends; after the token already sent
        await decode.recompute(request_id, tokens[0] if tokens else None)
    async for output in decode.stream(request_id, tokens[0] if tokens else None):
        tokens += output.token_ids[len(tokens):]
    return tokens


def assert_whole(*workers: Worker) -> None:
    for worker in workers:
        pool = worker.engine.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks, worker.worker_id


@contextlib.asynccontextmanager
async def running_pair(path: Path, prefill_engine: LLMEngine | None = None,
                       ) -> AsyncIterator[tuple[Worker, Worker, LoopbackHub]]:
    """A started prefill and decode worker joined by a loopback hub; stopped on the way out."""
    hub = LoopbackHub()
    prefill = Worker("prefill-0", "prefill", prefill_engine or make_engine(path, budget=6), sender=LoopbackSender(hub))
    decode = Worker("decode-0", "decode", make_engine(path), receiver=LoopbackReceiver(hub, "decode-0"))
    await prefill.start()
    await decode.start()
    try:
        yield prefill, decode, hub
    finally:
        await prefill.stop()
        await decode.stop()


def test_concurrent_requests_match_the_engine_alone(checkpoint: Path, expected: list[list[int]]) -> None:
    async def main() -> None:
        async with running_pair(checkpoint) as (prefill, decode, _):
            got = await asyncio.gather(*(serve(prefill, decode, f"r{i}", p) for i, p in enumerate(PROMPTS)))
            assert list(got) == expected
            assert len(prefill.transfers) == len(PROMPTS) and all(t.nbytes > 0 for t in prefill.transfers)
            # The prefill's budget (6 tokens) computes long prompts in chunks: their KV left in several frames.
            assert max(t.frames for t in prefill.transfers) >= 5
            await asyncio.sleep(0.1)
            assert_whole(prefill, decode)

    asyncio.run(main())


def test_seeded_sampling_split_over_two_workers_equals_one_engine(checkpoint: Path) -> None:
    """A seed gives the same tokens whether one engine or a prefill and a decode worker sample them:
    the prefill samples the first token with every parameter (penalties over the prompt too), the
    decode worker's generator skips that token's draw; and a run resumed after 5 tokens with
    `seed_offset=5` goes on as the whole run."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, repetition_penalty=1.5, presence_penalty=0.5,
                            min_tokens=2, ignore_eos=True)
    engine = make_engine(checkpoint)
    alone = [engine.generate([prompt], params)[0].token_ids for prompt in PROMPTS]
    resumed = replace(params, max_tokens=7, min_tokens=0, seed_offset=5)

    async def main() -> None:
        async with running_pair(checkpoint) as (prefill, decode, _):
            got = await asyncio.gather(*(serve(prefill, decode, f"s{i}", p, params) for i, p in enumerate(PROMPTS)))
            assert list(got) == alone
            rest = await serve(prefill, decode, "resumed", PROMPTS[1] + alone[1][:5], resumed)
            assert rest == alone[1][5:]

    asyncio.run(main())


@pytest.mark.parametrize("mode", [FailMode.UNREACHABLE, FailMode.PEER_LOST, FailMode.CORRUPT_HEADER])
def test_failed_transfers_are_recomputed_by_the_decode_worker(checkpoint: Path, expected: list[list[int]],
                                                             mode: FailMode) -> None:
    async def main() -> None:
        async with running_pair(checkpoint) as (prefill, decode, hub):
            hub.fail_next(2, mode)
            got = await asyncio.gather(*(serve(prefill, decode, f"r{i}", p) for i, p in enumerate(PROMPTS)))
            assert list(got) == expected
            await asyncio.sleep(0.1)
            assert_whole(prefill, decode)

    asyncio.run(main())


def test_a_client_that_stops_listening_frees_blocks_on_both_workers(checkpoint: Path) -> None:
    async def main() -> None:
        async with running_pair(checkpoint) as (prefill, decode, _):
            params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            address = await decode.reserve("long", PROMPTS[0], params)
            assert address is not None
            async for _ in prefill.prefill("long", PROMPTS[0], params, address):
                pass
            stream = decode.stream("long")
            await anext(stream)
            await stream.aclose()  # the client went away
            await asyncio.sleep(0.1)
            assert not decode.engine.has_unfinished_requests()
            assert_whole(prefill, decode)

    asyncio.run(main())


def test_kv_that_never_comes_is_recomputed_when_the_lease_ends(checkpoint: Path, expected: list[list[int]]) -> None:
    async def main() -> None:
        async with running_pair(checkpoint) as (prefill, decode, _):
            assert await decode.reserve("orphan", PROMPTS[0], GREEDY, lease_s=0.2) is not None
            tokens = [t for output in [o async for o in decode.stream("orphan")] for t in output.new_token_ids]
            assert tokens == expected[0]
            assert_whole(decode)
            # The receiver no longer holds a landing buffer for KV nobody waits for.
            assert decode.receiver is not None and decode.receiver.state("orphan") == TransferState.CANCELLED

    asyncio.run(main())


def test_an_abort_while_the_landing_buffer_is_made_leaves_no_transfer_expected(checkpoint: Path) -> None:
    async def main() -> None:
        async with running_pair(checkpoint) as (_, decode, _):
            assert decode.receiver is not None
            made, go_on = asyncio.Event(), asyncio.Event()
            landing_memory = decode.receiver.landing_memory

            async def slow_landing_memory(token: str, nbytes: int) -> memoryview | None:
                made.set()  # as a new shared-memory segment is faulted in on a thread
                await go_on.wait()
                return await landing_memory(token, nbytes)

            decode.receiver.landing_memory = slow_landing_memory  # type: ignore[method-assign]
            reserving = asyncio.create_task(decode.reserve("gone", PROMPTS[0], GREEDY))
            await made.wait()
            assert await decode.abort("gone")
            go_on.set()
            await reserving
            assert decode.receiver.state("gone") == TransferState.CANCELLED
            assert_whole(decode)

    asyncio.run(main())


def test_an_abort_from_elsewhere_ends_the_stream_and_ids_are_not_shared(checkpoint: Path) -> None:
    async def main() -> None:
        async with running_pair(checkpoint) as (prefill, decode, _):
            params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            address = await decode.reserve("cut", PROMPTS[0], params)
            assert address is not None
            with pytest.raises(ValueError, match="already in use"):
                await decode.reserve("cut", PROMPTS[0], params)
            async for _ in prefill.prefill("cut", PROMPTS[0], params, address):
                pass
            outputs = []
            async for output in decode.stream("cut"):
                outputs.append(output)
                if len(outputs) == 3:
                    assert await decode.abort("cut")  # as the gateway or another router replica would
            assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
            await asyncio.sleep(0.1)
            assert_whole(prefill, decode)

    asyncio.run(main())


def test_a_refused_prompt_leaves_nothing_behind_and_its_id_stays_usable(checkpoint: Path) -> None:
    """A prompt the model cannot take (token ids past the vocabulary) is refused by the decode worker
    with nothing of it kept: no stream entry stays behind to refuse the id for good."""
    async def main() -> None:
        async with running_pair(checkpoint) as (prefill, decode, _):
            with pytest.raises(ValueError, match="token ids"):
                await decode.reserve("poison", [5, 10**6], GREEDY)
            assert not decode.streams and decode.receiver.state("poison") is None
            assert await serve(prefill, decode, "poison", PROMPTS[0]) == (await asyncio.to_thread(
                lambda: make_engine(checkpoint).generate([PROMPTS[0]], GREEDY)[0].token_ids))
            assert not decode.streams and not prefill.streams
            assert_whole(prefill, decode)

    asyncio.run(main())


def test_forged_kv_frames_are_refused_and_a_bad_first_token_is_recomputed(checkpoint: Path,
                                                                           expected: list[list[int]]) -> None:
    """A peer that reaches the decode worker's receiver without the ticket's token lands nothing; one
    with the token whose first token id is outside the vocabulary (a broken sender) does not get it
    into the stream (nor break the engine thread): the prompt is recomputed, the answer is right."""
    async def main() -> None:
        async with running_pair(checkpoint) as (prefill, decode, hub):
            forger = LoopbackSender(hub)
            prompt = PROMPTS[0]
            runner = decode.engine.runner
            num_blocks = -(-len(prompt) // 4)
            nbytes = num_blocks * len(runner.kv_caches) * 2 * runner.kv_caches[0][0, 0].numel() * 4

            def frame(request_id: str, token: str, first_token_id: int) -> KVHeader:
                shape = runner.kv_caches[0].shape
                return KVHeader(request_id=request_id, num_tokens=len(prompt), num_blocks=num_blocks, block_size=4,
                                num_layers=len(runner.kv_caches), num_kv_heads=shape[3], head_dim=shape[4],
                                dtype="float32", first_token_id=first_token_id, nbytes=nbytes, token=token)

            ticket = await decode.reserve("forged", prompt, GREEDY)
            assert ticket is not None and ticket.token and ticket.token not in repr(ticket)
            with pytest.raises(FrameRefused) as refused:
                await forger.send(ticket.address, frame("forged", "guess", 7), memoryview(bytearray(nbytes)))
            assert refused.value.code is Refusal.UNAUTHENTICATED
            tokens: list[int] = []
            async for item in prefill.prefill("forged", prompt, GREEDY, ticket):
                if not isinstance(item, TransferStats):
                    tokens += item.new_token_ids
            async for output in decode.stream("forged"):
                tokens += output.token_ids[len(tokens):]
            assert tokens == expected[0]

            ticket = await decode.reserve("bad-first", prompt, GREEDY)
            assert ticket is not None
            await forger.send(ticket.address, frame("bad-first", ticket.token, 10**9), memoryview(bytearray(nbytes)))
            outputs = [output async for output in decode.stream("bad-first")]
            assert outputs[-1].token_ids == expected[0] and decode.engine.scheduler.num_recomputes == 1
            await asyncio.sleep(0.1)
            assert_whole(prefill, decode)

    asyncio.run(main())


def test_an_engine_thread_that_fails_outside_a_step_fails_the_worker_loudly(checkpoint: Path) -> None:
    """The KV import runs on the engine thread outside any step. One that raises must not leave the
    worker alive with a dead thread, where every later call would hang: its stream gets the error, the
    worker reports why, `on_fatal` hears of it (a Ray actor ends its process there, so Ray restarts
    it), and every later call fails at once."""
    fatal: list[BaseException] = []

    async def main() -> None:
        hub = LoopbackHub()
        prefill = Worker("prefill-0", "prefill", make_engine(checkpoint), sender=LoopbackSender(hub))
        decode = Worker("decode-0", "decode", make_engine(checkpoint), receiver=LoopbackReceiver(hub, "decode-0"),
                        on_fatal=fatal.append)
        await prefill.start()
        await decode.start()

        def corrupt_import(*_: object) -> None:
            raise RuntimeError("a KV import that went wrong")

        decode.engine.import_kv = corrupt_import  # type: ignore[method-assign]
        try:
            with pytest.raises(RuntimeError, match="a KV import that went wrong"):
                await asyncio.wait_for(serve(prefill, decode, "doomed", PROMPTS[0]), 30)
            for _ in range(100):  # the engine thread calls on_fatal just after it marks itself broken
                if fatal:
                    break
                await asyncio.sleep(0.05)
            assert len(fatal) == 1 and "a KV import that went wrong" in decode.failure
            with pytest.raises(RuntimeError, match="engine thread failed"):
                await asyncio.wait_for(decode.load(), 5)  # at once, not a hang
            with pytest.raises(RuntimeError, match="engine thread failed"):
                await asyncio.wait_for(decode.reserve("next", PROMPTS[1], GREEDY), 5)
        finally:
            await prefill.stop()
            await decode.stop()

    asyncio.run(main())


def test_after_a_failed_transfer_the_decode_worker_goes_on_after_the_streamed_first_token(checkpoint: Path) -> None:
    """The prefill worker streamed the first token, then its KV could not be sent. The decode worker
    computes the prompt itself, and goes on after THAT token (the client has it), not after a first
    token of its own: with unseeded sampling its own would differ (and the text would be spliced)."""
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)  # no seed: nothing repeats

    async def main() -> None:
        hub = LoopbackHub(latency_s=0.05)  # the send fails after the first token went out, as on a network
        # The whole prompt in one step: its one frame, carrying the first token, is the one that fails.
        prefill = Worker("prefill-0", "prefill", make_engine(checkpoint), sender=LoopbackSender(hub))
        decode = Worker("decode-0", "decode", make_engine(checkpoint), receiver=LoopbackReceiver(hub, "decode-0"))
        await prefill.start()
        await decode.start()
        try:
            for attempt in range(3):
                request_id = f"splice-{attempt}"
                hub.fail_next(1, FailMode.UNREACHABLE)
                prompt = PROMPTS[attempt]  # each its own: a prefix-cache hit would send blocks earlier
                ticket = await decode.reserve(request_id, prompt, params)
                assert ticket is not None
                streamed: list[int] = []
                with pytest.raises(TransferError):
                    async for item in prefill.prefill(request_id, prompt, params, ticket):
                        if not isinstance(item, TransferStats):
                            streamed += item.new_token_ids
                assert len(streamed) == 1
                await decode.recompute(request_id, streamed[0])
                outputs = [output async for output in decode.stream(request_id)]
                # Restated, as when KV lands (the stream merges the outputs its reader has not taken yet).
                assert outputs[0].index == 0 and outputs[0].new_token_ids[:1] == streamed
                assert outputs[-1].token_ids[0] == streamed[0] and len(outputs[-1].token_ids) == 8
                assert decode.engine.scheduler.num_recomputes == attempt + 1
            await asyncio.sleep(0.1)
            assert_whole(prefill, decode)
        finally:
            await prefill.stop()
            await decode.stop()

    asyncio.run(main())


def test_a_lease_that_ends_before_the_kv_comes_goes_on_after_the_first_token_the_prefill_streamed(
        checkpoint: Path) -> None:
    """The decode worker's lease ends while the prompt waits on an overloaded prefill worker, which then
    computes it and streams its first token to the client anyway. The decode worker must not have
    sampled a first token of its own meanwhile: told the client's token when its stream opens, it
    computes the prompt and goes on after that token (unseeded sampling: its own would differ)."""
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)  # no seed: nothing repeats

    async def main() -> None:
        async with running_pair(checkpoint) as (prefill, decode, _):
            for attempt in range(3):
                request_id, prompt = f"late-{attempt}", PROMPTS[attempt]
                ticket = await decode.reserve(request_id, prompt, params, lease_s=0.05)
                assert ticket is not None
                await asyncio.sleep(0.3)  # the lease ends before the prefill worker gets to the prompt
                assert request_id in decode.engine.scheduler.parked  # no first token of its own sampled
                streamed: list[int] = []
                with contextlib.suppress(TransferError):
                    async for item in prefill.prefill(request_id, prompt, params, ticket):
                        if not isinstance(item, TransferStats):
                            streamed += item.new_token_ids
                assert len(streamed) == 1
                outputs = [output async for output in decode.stream(request_id, streamed[0])]
                assert outputs[-1].token_ids[0] == streamed[0] and len(outputs[-1].token_ids) == 8
                assert decode.engine.scheduler.num_recomputes == attempt + 1
            await asyncio.sleep(0.1)
            assert_whole(prefill, decode)

    asyncio.run(main())


def test_a_streamed_first_token_that_ends_the_request_ends_it_on_the_decode_worker(checkpoint: Path) -> None:
    """max_tokens 1: the prefill's token was the whole answer; the recompute has nothing to compute."""
    params = SamplingParams(max_tokens=1, temperature=1.0)

    async def main() -> None:
        async with running_pair(checkpoint) as (_, decode, _):
            ticket = await decode.reserve("one", PROMPTS[0], params)
            assert ticket is not None
            await decode.recompute("one", 42)
            outputs = [output async for output in decode.stream("one")]
            assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outputs] == [([42], True, "length")]
            assert_whole(decode)

    asyncio.run(main())


def test_kv_from_a_prefill_worker_in_another_dtype_lands_without_a_recompute(checkpoint: Path) -> None:
    """dtype auto resolves on each worker's own CPU: a bf16 prefill worker (AVX512-BF16) and an fp32
    decode worker (AVX2) in one cluster. The prefill sends its KV in the dtype the ticket names, so the
    decode worker's blocks take it as they are, with no transfer failed and recomputed."""
    async def main() -> None:
        bf16 = LLMEngine(EngineConfig(model=replace(fp32_model(checkpoint), dtype="bfloat16"),
                                      cache=CacheConfig(block_size=4, num_blocks=128)))
        async with running_pair(checkpoint, prefill_engine=bf16) as (prefill, decode, _):
            got = await asyncio.gather(*(serve(prefill, decode, f"d{i}", p) for i, p in enumerate(PROMPTS)))
            assert [len(tokens) for tokens in got] == [GREEDY.max_tokens] * len(PROMPTS)
            assert (await decode.load()).kv_recomputes == 0
            assert len(prefill.transfers) == len(PROMPTS) and prefill.transfer_failures == 0
            await asyncio.sleep(0.1)
            assert_whole(prefill, decode)

    asyncio.run(main())
