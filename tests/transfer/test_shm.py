"""Same-host KV through shared memory (cluster/transfer/shm.py): bytes land bit for bit whatever the
dtype, a peer process killed mid-transfer is seen within seconds on either side, an abort
mid-transfer frees every block and segment, and the path is chosen only for a receiver on this host."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.transfer import shm
from cluster.transfer.connector import KVHeader, TransferError, TransferState
from cluster.transfer.loopback import FrameRefused, Refusal
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.worker import Worker
from tests.engine.test_engine_outputs import GREEDY, PROMPTS
from tests.helpers import fp32_model
from tests.transfer.conftest import HAS_UCXX, TIMEOUT_S, Pair
from tests.transfer.peer import frames, payload
from tests.transfer.test_cross_process import read_line, start_peer

pytestmark = pytest.mark.skipif(not HAS_UCXX, reason="ucxx is not installed (pip install ucxx-cu13)")
# A killed peer must be seen within this (UCX over TCP sees a reset in tens of milliseconds).
DETECTED_WITHIN_S = 5.0


@pytest.fixture
def segment_dir() -> Iterator[Path]:
    """A directory in /dev/shm of this test's own, so that leftover segments can be counted."""
    path = Path(tempfile.mkdtemp(prefix="pdserve-test-", dir=shm.SHM_DIR))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def shm_pair(loop: asyncio.AbstractEventLoop, segment_dir: Path) -> Iterator[Pair]:
    from cluster.transfer.ucx import UCXReceiver, UCXSender

    sender = UCXSender(timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S, segment_dir=str(segment_dir))
    receiver = UCXReceiver(timeout_s=TIMEOUT_S, segment_dir=str(segment_dir))
    loop.run_until_complete(receiver.start())
    yield Pair("shm", loop, sender, receiver)
    loop.run_until_complete(sender.close())
    loop.run_until_complete(receiver.close())


def named_for(landing: str, segment_dir: Path) -> list[str]:
    """The segments of the name a transfer's ticket gives (`landing_name`): there while it runs, gone
    once it ended."""
    return [name for name in os.listdir(segment_dir) if landing and name.endswith(f"-{landing}")]


def kv_frames(request_id: str, data: torch.Tensor, token: str, split: int) -> list[tuple[KVHeader, memoryview]]:
    """`data` (blocks x layers x 2 x block_size x heads x dim) as two frames: blocks [0, split) and the rest."""
    blocks, layers, _, block_size, heads, dim = data.shape
    flat = memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")
    block_nbytes = flat.nbytes // blocks
    headers = [KVHeader(request_id=request_id, num_tokens=blocks * block_size, num_blocks=stop - start,
                        block_size=block_size, num_layers=layers, num_kv_heads=heads, head_dim=dim,
                        dtype=str(data.dtype).removeprefix("torch."), first_token_id=3,
                        nbytes=(stop - start) * block_nbytes, first_block=start, last=stop == blocks, token=token)
               for start, stop in ((0, split), (split, blocks))]
    return [(header, flat[header.first_block * block_nbytes:][:header.nbytes]) for header in headers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn],
                         ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_kv_of_any_dtype_lands_bit_for_bit_through_shared_memory(shm_pair: Pair, segment_dir: Path,
                                                                  dtype: torch.dtype) -> None:
    """Random bits (NaNs and infinities included) of a KV-shaped tensor, in two frames written in place."""
    shape = (6, 3, 2, 4, 2, 8)
    bits = torch.from_numpy(payload(int(np.prod(shape)) * dtype.itemsize, seed=dtype.itemsize).copy())
    data = bits.view(dtype).view(shape)

    async def body() -> None:
        landing = await shm_pair.receiver.landing_memory("ab12", bits.numel())
        assert landing is not None and len(os.listdir(segment_dir)) == 1
        staging = torch.frombuffer(landing, dtype=dtype).view(shape)
        done = shm_pair.receiver.expect("r1", memoryview(staging.view(torch.uint8).numpy()).cast("B"), "ab12")
        name = shm_pair.receiver.landing_name("ab12")
        for header, view in kv_frames("r1", data, "ab12", split=4):
            assert await shm_pair.sender.send(shm_pair.receiver.address, header, view, name) == shm.TRANSPORT_SHM
        assert (await done).dtype == str(dtype).removeprefix("torch.")
        assert torch.equal(staging.view(torch.uint8).reshape(-1), bits)
        await asyncio.sleep(0)  # the future's done-callbacks (in one process the ack may come first)
        assert named_for(name, segment_dir) == []  # the transfer's name goes with it

    shm_pair.run(body())


def test_no_name_in_shared_memory_shows_a_transfers_token(shm_pair: Pair, segment_dir: Path) -> None:
    """Any local user can list /dev/shm: a segment's name must not give away the token that lets a
    peer land KV frames. The name is random; the sender finds it in the ticket (`landing`), and the
    receiver still takes an in-place frame only with the token in its header."""
    token, nbytes = secrets.token_hex(16), 1 << 20
    data = payload(nbytes, seed=8)
    header = frames("t1", nbytes, token, count=1)[0]

    async def body() -> tuple[list[str], str]:
        landing = await shm_pair.receiver.landing_memory(token, nbytes)
        assert landing is not None
        done = shm_pair.receiver.expect("t1", landing, token)
        names = os.listdir(segment_dir)  # the transfer is set up: what a local user sees now
        assert names and not any(shows(token, shown) for shown in names), names
        name = shm_pair.receiver.landing_name(token)
        with pytest.raises(FrameRefused) as refused:  # the segment's name without the token: refused
            await shm_pair.sender.send(shm_pair.receiver.address, replace(header, token="0" * 32),
                                       memoryview(data), landing=name)
        assert refused.value.code is Refusal.UNAUTHENTICATED
        assert await shm_pair.sender.send(shm_pair.receiver.address, header, memoryview(data),
                                          landing=name) == shm.TRANSPORT_SHM
        await done
        assert np.array_equal(np.frombuffer(landing, dtype=np.uint8), data)
        return names, name

    names, name = shm_pair.run(body())
    assert names == [f"{shm.SEGMENT_PREFIX}{shm_pair.receiver._segments.receiver_id}-{name}"]  # noqa: SLF001


def shows(token: str, name: str) -> bool:
    """Whether a file name holds the token, a hash of it, or any 8 characters of it in a row."""
    digests = (hashlib.sha256(token.encode()).hexdigest(), hashlib.sha256(bytes.fromhex(token)).hexdigest())
    return any(part in name.lower() for text in (token, *digests) for part in
               (text[i:i + 8] for i in range(len(text) - 7)))


def test_frames_large_enough_to_stream_land_bit_for_bit_at_their_offsets(shm_pair: Pair, segment_dir: Path) -> None:
    """Two frames each over `stream_copy.STREAM_MIN` (copied with streaming stores, in chunks), of a
    length no multiple of any vector, the second at an unaligned offset: every byte lands."""
    from cluster.transfer import stream_copy

    frame_nbytes = stream_copy.STREAM_MIN + 4096 + 77
    nbytes, data = 2 * frame_nbytes, payload(2 * frame_nbytes, seed=9)
    assert stream_copy.streams(frame_nbytes)

    async def body() -> None:
        landing = await shm_pair.receiver.landing_memory("ab34", nbytes)
        assert landing is not None
        done = shm_pair.receiver.expect("big", landing, "ab34")
        name = shm_pair.receiver.landing_name("ab34")
        for index, header in enumerate(frames("big", nbytes, "ab34")):
            view = memoryview(data)[index * frame_nbytes:(index + 1) * frame_nbytes]
            assert await shm_pair.sender.send(shm_pair.receiver.address, header, view, name) == shm.TRANSPORT_SHM
        await done
        assert np.array_equal(np.frombuffer(landing, dtype=np.uint8), data)

    shm_pair.run(body())


def test_an_in_place_frame_costs_the_sender_two_messages(shm_pair: Pair, segment_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Length prefix and header go as one message, then the marker: each message is a wake-up of the
    receiver (on a loaded 2-core host, often on the sender's own core), so there are no more. The
    post is wrapped to record what it sends, and sends it as before."""
    from cluster.transfer import ucx

    posted: list[bytes] = []
    post_send = ucx._Link.post_send

    def counted(link: ucx._Link, buffer: bytearray) -> object:
        posted.append(bytes(buffer))
        return post_send(link, buffer)

    monkeypatch.setattr(ucx._Link, "post_send", counted)
    nbytes = 1 << 20
    header = frames("one", nbytes, "ab56", count=1)[0]

    async def body() -> None:
        landing = await shm_pair.receiver.landing_memory("ab56", nbytes)
        assert landing is not None
        done = shm_pair.receiver.expect("one", landing, "ab56")
        await shm_pair.sender.send(shm_pair.receiver.address, header, memoryview(payload(nbytes, seed=4)),
                                   shm_pair.receiver.landing_name("ab56"))
        await done

    shm_pair.run(body())
    opening = replace(header, in_place=True).to_bytes()
    # The receiver runs in this process too: its ack (0: landed) is the third message.
    assert posted == [ucx.PREFIX.pack(len(opening)) + opening, ucx.WRITTEN, b"\x00"]


def test_a_buffer_that_is_no_segment_gets_its_bytes_over_ucx(shm_pair: Pair, segment_dir: Path) -> None:
    """The fallback: a receiver on this host whose caller gave ordinary memory gets the payload on the wire."""
    data = payload(2 * 4096, seed=5)
    buffer = np.zeros(data.nbytes, dtype=np.uint8)

    async def body() -> None:
        done = shm_pair.receiver.expect("plain", memoryview(buffer), "cd34")
        for index, header in enumerate(frames("plain", data.nbytes, "cd34")):
            part = memoryview(data)[index * header.nbytes:][:header.nbytes]
            assert await shm_pair.sender.send(shm_pair.receiver.address, header, part) == shm.TRANSPORT_UCX
        await done

    shm_pair.run(body())
    assert np.array_equal(buffer, data)


def test_a_receiver_killed_mid_transfer_fails_the_send_within_seconds(shm_pair: Pair, segment_dir: Path) -> None:
    """Frame 1 of 2 lands in another process's segment; that process is killed; frame 2 (its segment
    still on disk, so it is mapped and written) fails with TransferError within seconds. The dead
    receiver's segment is removed by the next receiver that looks for orphans."""
    nbytes, token = 8 << 20, "ef56"
    data = payload(nbytes, seed=9)
    first, second = frames("k1", nbytes, token)

    async def body() -> float:
        peer = await start_peer("receive-shm", str(segment_dir), f"k1:{nbytes}:{token}")
        name = (await read_line(peer)).removeprefix("landing k1 ")
        address = (await read_line(peer)).removeprefix("address ")
        try:
            assert await shm_pair.sender.send(address, first, memoryview(data)[:first.nbytes],
                                              name) == shm.TRANSPORT_SHM
        finally:
            peer.send_signal(signal.SIGKILL)
            await peer.wait()
        started = time.monotonic()
        with pytest.raises(TransferError):
            await shm_pair.sender.send(address, second, memoryview(data)[first.nbytes:], name)
        return time.monotonic() - started

    assert shm_pair.run(body()) < DETECTED_WITHIN_S
    assert len(os.listdir(segment_dir)) == 1  # left by the killed receiver
    assert shm.Segments(str(segment_dir)).remove_orphans() == 1
    assert os.listdir(segment_dir) == []


def test_a_sender_killed_mid_copy_fails_the_transfer_within_seconds(shm_pair: Pair, segment_dir: Path) -> None:
    """Another process sends a frame in place and is killed halfway through its copy: the transfer
    fails with TransferError (the decode worker would recompute) within seconds, its segment unlinked."""
    nbytes, token = 1 << 20, "0a0b"

    async def body() -> float:
        landing = await shm_pair.receiver.landing_memory(token, nbytes)
        assert landing is not None
        done = shm_pair.receiver.expect("k2", landing, token)
        peer = await start_peer("stall-shm", str(segment_dir), shm_pair.receiver.address,
                                f"k2:{nbytes}:{token}:3:{shm_pair.receiver.landing_name(token)}")
        try:
            assert await read_line(peer) == "stalled"
            while shm_pair.receiver.state("k2") is not TransferState.RECEIVING:
                await asyncio.sleep(0.01)  # the header went out before the copy: it is on its way
        finally:
            peer.send_signal(signal.SIGKILL)
            await peer.wait()
        started = time.monotonic()
        with pytest.raises(TransferError):
            await done
        return time.monotonic() - started

    assert shm_pair.run(body()) < DETECTED_WITHIN_S
    assert shm_pair.receiver.state("k2") is TransferState.FAILED
    assert os.listdir(segment_dir) == []


def test_the_path_is_chosen_only_for_a_receiver_on_this_host(segment_dir: Path) -> None:
    from cluster.transfer.ucx import UCXSender, parse_address

    here = shm.SameHost(shm.host_identity(), "123x0badf00d")
    elsewhere = replace(here, host="0" * 16)
    sender = UCXSender(segment_dir=str(segment_dir))
    assert sender.transport_to("ucx://10.0.0.7:4000" + here.suffix()) == shm.TRANSPORT_SHM
    assert sender.transport_to("ucx://127.0.0.1:4000" + elsewhere.suffix()) == shm.TRANSPORT_UCX  # never by IP
    assert sender.transport_to("ucx://127.0.0.1:4000") == shm.TRANSPORT_UCX  # a receiver that offers none
    # With the transfer's segment name: "shm" only if the receiver made it (else the send falls back).
    assert sender.transport_to("ucx://10.0.0.7:4000" + here.suffix(), "beef") == shm.TRANSPORT_UCX
    Path(shm.segment_path(here.receiver_id, "beef", str(segment_dir))).touch()
    assert sender.transport_to("ucx://10.0.0.7:4000" + here.suffix(), "beef") == shm.TRANSPORT_SHM
    assert UCXSender(shared_memory=False).transport_to("ucx://10.0.0.7:4000" + here.suffix()) == shm.TRANSPORT_UCX
    assert parse_address("ucx://10.0.0.7:4000" + here.suffix()) == ("10.0.0.7", 4000)
    assert shm.SameHost.of("ucx://h:1?host=../../etc&rid=1x00000000") is None  # names no path outside the dir


def test_the_cluster_config_turns_shared_memory_off_and_names_a_bad_value() -> None:
    from cluster.ray_cluster.config import load_cluster_config

    assert load_cluster_config().kv_shared_memory is True
    assert load_cluster_config(overrides={"kv_shared_memory": False}).kv_shared_memory is False
    with pytest.raises(ValueError, match="kv_shared_memory must be one of"):
        load_cluster_config(overrides={"kv_shared_memory": "yes"})


def test_host_identity_tells_network_namespaces_apart() -> None:
    """Two "hosts" made of network namespaces on one kernel (as tests/deploy does) share the boot id
    and may share the hostname: the namespace keeps them apart, so each dials the other over TCP."""
    assert shm.host_identity() == shm.host_identity()
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    import subprocess
    import sys

    probe = [sys.executable, "-c", "from cluster.transfer.shm import host_identity; print(host_identity())"]
    other = subprocess.run(["unshare", "--net", "--map-root-user", *probe], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[2], check=False)
    if other.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {other.stderr.strip()[:200]}")
    assert other.stdout.strip() != shm.host_identity()


# ---- through the workers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def make_engine(path: Path, dtype: str = "float32", budget: int = 2048) -> LLMEngine:
    return LLMEngine(EngineConfig(model=replace(fp32_model(path), dtype=dtype),
                                  cache=CacheConfig(block_size=4, num_blocks=128),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


async def start_workers(prefill_engine: LLMEngine, decode_engine: LLMEngine,
                        segment_dir: Path) -> tuple[Worker, Worker]:
    from cluster.transfer.ucx import UCXReceiver, UCXSender

    prefill = Worker("prefill-0", "prefill", prefill_engine,
                     sender=UCXSender(timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S, segment_dir=str(segment_dir)))
    decode = Worker("decode-0", "decode", decode_engine,
                    receiver=UCXReceiver(timeout_s=TIMEOUT_S, segment_dir=str(segment_dir)))
    await prefill.start()
    await decode.start()
    return prefill, decode


def assert_whole(*workers: Worker) -> None:
    for worker in workers:
        pool = worker.engine.kv_cache.pool
        assert pool.num_free_blocks == pool.num_blocks, worker.worker_id


def test_kv_from_a_bf16_prefill_lands_in_an_fp32_decode_worker_through_shared_memory(
        loop: asyncio.AbstractEventLoop, checkpoint: Path, segment_dir: Path) -> None:
    """The ticket's dtype (fp32) is what the bf16 prefill converts to and sends in place: the decode
    worker continues the prompts with no recompute, as it does after an fp32 prefill (checked too)."""
    from tests.worker.test_worker_disaggregated import serve

    alone = make_engine(checkpoint)
    expected = [alone.generate([prompt], GREEDY)[0].token_ids for prompt in PROMPTS]

    async def body() -> None:
        for prefill_dtype in ("float32", "bfloat16"):
            prefill, decode = await start_workers(make_engine(checkpoint, prefill_dtype, budget=8),
                                                  make_engine(checkpoint), segment_dir)
            try:
                got = await asyncio.gather(*(serve(prefill, decode, f"m{i}", p) for i, p in enumerate(PROMPTS)))
                if prefill_dtype == "float32":
                    assert list(got) == expected
                else:
                    assert [len(tokens) for tokens in got] == [GREEDY.max_tokens] * len(PROMPTS)
                assert (await decode.load()).kv_recomputes == 0 and prefill.transfer_failures == 0
                assert {stats.transport for stats in prefill.transfers} == {shm.TRANSPORT_SHM}
                assert max(stats.frames for stats in prefill.transfers) >= 3  # chunked: several frames in place
                await asyncio.sleep(0.1)
                assert_whole(prefill, decode)
                assert all("idle" in name for name in os.listdir(segment_dir))  # pooled for the next ones
            finally:
                await prefill.stop()
                await decode.stop()
            assert os.listdir(segment_dir) == []  # a receiver that closes leaves nothing in /dev/shm

    loop.run_until_complete(asyncio.wait_for(body(), 60))


def test_an_abort_mid_transfer_frees_every_block_and_segment(loop: asyncio.AbstractEventLoop, checkpoint: Path,
                                                             segment_dir: Path) -> None:
    """The gateway aborts a request (both workers, as the router does) once some of its frames landed
    in place and more are coming: the transfer stops, every block goes back to both pools, and no
    segment is left in /dev/shm."""
    prompt = [int(token) for token in np.random.default_rng(1).integers(3, 250, 200)]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

    async def body() -> None:
        prefill, decode = await start_workers(make_engine(checkpoint, budget=4), make_engine(checkpoint),
                                              segment_dir)
        try:
            ticket = await decode.reserve("cut", prompt, params)
            assert ticket is not None and shm.SameHost.of(ticket.address) is not None

            async def run_prefill() -> None:
                async for _ in prefill.prefill("cut", prompt, params, ticket):
                    pass

            prefilling = asyncio.create_task(run_prefill())
            while decode.receiver.state("cut") is not TransferState.PARTIAL:  # type: ignore[union-attr]
                assert not prefilling.done(), "the whole prompt was sent before the test could abort it"
                await asyncio.sleep(0)
            assert await decode.abort("cut")
            await prefill.abort("cut")
            # The prefill ends aborted, or (had its next frame gone out first) refused as cancelled.
            with contextlib.suppress(TransferError):
                await prefilling
            assert prefill.transfer_count == 0  # no last frame went out
            assert decode.receiver.state("cut") is TransferState.CANCELLED  # type: ignore[union-attr]
            await asyncio.sleep(0.1)
            assert_whole(prefill, decode)
            assert os.listdir(segment_dir) == []
        finally:
            await prefill.stop()
            await decode.stop()

    loop.run_until_complete(asyncio.wait_for(body(), 60))


def test_only_the_segment_of_a_transfer_that_landed_is_handed_out_again(shm_pair: Pair, segment_dir: Path) -> None:
    """A cancelled transfer's sender may still be copying into its segment: that segment is unlinked,
    never reused. One whose transfer landed (its sender is done) is, once its view is dropped."""
    nbytes = 3 << 20
    data = payload(nbytes, seed=4)

    async def land(token: str) -> tuple[int, str]:
        landing = await shm_pair.receiver.landing_memory(token, nbytes)
        assert landing is not None
        name = shm_pair.receiver.landing_name(token)
        where = (shm.address_of(landing), named_for(name, segment_dir)[0])
        done = shm_pair.receiver.expect(f"r-{token}", landing, token)
        header = frames(f"r-{token}", nbytes, token, count=1)[0]
        assert await shm_pair.sender.send(shm_pair.receiver.address, header, memoryview(data),
                                          name) == shm.TRANSPORT_SHM
        await done
        return where

    async def pooled() -> None:
        deadline = time.monotonic() + 10
        segments = shm_pair.receiver._segments  # noqa: SLF001 (the pool itself: its file is renamed idle earlier)
        assert segments is not None
        while segments.pooled_bytes == 0:
            assert time.monotonic() < deadline, "the landed transfer's segment never went back to the pool"
            gc.collect()  # a view held by a reference cycle goes at a collection
            await asyncio.sleep(0.01)

    async def body() -> None:
        first, _ = await land("aa01")  # landed; its view dropped on return
        assert [name for name in os.listdir(segment_dir) if "idle" in name]
        assert (await land("aa02"))[0] == first  # the same memory again
        await pooled()  # back in the pool (in a full suite once not yet when the next one asked)
        cancelled = await shm_pair.receiver.landing_memory("aa03", nbytes)
        assert cancelled is not None and shm.address_of(cancelled) == first
        shm_pair.receiver.expect("r-aa03", cancelled, "aa03")
        shm_pair.receiver.cancel("r-aa03")
        del cancelled
        await asyncio.sleep(0)  # the future's done-callbacks
        assert os.listdir(segment_dir) == []  # unlinked, not pooled
        again = await shm_pair.receiver.landing_memory("aa04", nbytes)
        assert again is not None and named_for(shm_pair.receiver.landing_name("aa04"), segment_dir)
        # A new segment (the cancelled one may be mapped at the same address again: compare the files).
        assert len(os.listdir(segment_dir)) == 1

    shm_pair.run(body())


def test_a_segment_whose_expect_is_refused_goes_at_once(shm_pair: Pair, segment_dir: Path) -> None:
    async def body() -> None:
        shm_pair.receiver.expect("dup", memoryview(bytearray(16)), "ee00")
        landing = await shm_pair.receiver.landing_memory("ee01", 1 << 20)
        name = shm_pair.receiver.landing_name("ee01")
        assert landing is not None and named_for(name, segment_dir)
        with pytest.raises(ValueError, match="already expected"):
            shm_pair.receiver.expect("dup", landing, "ee01")
        assert named_for(name, segment_dir) == []
        shm_pair.receiver.cancel("dup")

    shm_pair.run(body())


def test_a_new_segment_is_faulted_in_off_the_event_loop(shm_pair: Pair, segment_dir: Path) -> None:
    """A new 64 MiB segment costs tens of milliseconds of kernel work (its pages zeroed, its page
    tables filled): the decode worker's loop must keep serving meanwhile. A task counts the loop's
    turns while the segment is made (made on the loop, it would get none), and the segment is whole
    (every page allocated: no SIGBUS later) when it is handed out. A pooled one comes without a turn."""
    nbytes = 64 << 20

    async def body() -> None:
        turns = 0

        async def count_turns() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        counter = asyncio.create_task(count_turns())
        await asyncio.sleep(0)
        try:
            before = turns
            landing = await shm_pair.receiver.landing_memory("fa01", nbytes)
            during_new = turns - before
            assert landing is not None and landing.nbytes == nbytes
            name = named_for(shm_pair.receiver.landing_name("fa01"), segment_dir)[0]
            assert os.stat(segment_dir / name).st_blocks * 512 >= nbytes
            shm_pair.receiver.expect("r-fa01", landing, "fa01")
            shm_pair.receiver.cancel("r-fa01")
            await asyncio.sleep(0)
            del landing
            assert during_new >= 10, f"the loop turned {during_new} times while a new segment was made"
        finally:
            counter.cancel()

    shm_pair.run(body())


def test_a_segment_made_for_a_caller_that_gave_up_goes_to_the_pool(loop: asyncio.AbstractEventLoop,
                                                                   segment_dir: Path) -> None:
    """A reservation cancelled while its new segment is being made: the segment, never handed out,
    is pooled once made (not leaked in /dev/shm, not lost), and the next transfer of its size gets it."""
    nbytes = 16 << 20
    segments = shm.Segments(str(segment_dir))

    async def body() -> None:
        making = asyncio.create_task(segments.allocate("fb01", nbytes))
        await asyncio.sleep(0)
        making.cancel()
        with pytest.raises(asyncio.CancelledError):
            await making
        while segments.pooled_bytes == 0:
            await asyncio.sleep(0.01)
        assert segments.pooled_bytes == nbytes and len(os.listdir(segment_dir)) == 1
        again = await segments.allocate("fb02", nbytes)
        assert again is not None and named_for(segments.landing_name("fb02"), segment_dir)
        assert len(os.listdir(segment_dir)) == 1
        segments.close()
        assert os.listdir(segment_dir) == []

    loop.run_until_complete(asyncio.wait_for(body(), 20))


def test_segments_prefaulted_ahead_are_pooled_and_handed_out(loop: asyncio.AbstractEventLoop,
                                                              segment_dir: Path) -> None:
    """`prefault` makes segments ahead of need (off the loop) and pools them, up to the pool's
    bytes; a transfer of that size then takes one without making another."""
    segments = shm.Segments(str(segment_dir), pool_bytes=8 << 20)

    async def body() -> None:
        assert await segments.prefault(3 << 20, count=3) == 2  # 4 MiB each: the third does not fit
        assert segments.pooled_bytes == 8 << 20 and len(os.listdir(segment_dir)) == 2
        landing = await segments.allocate("fc01", 3 << 20)
        assert landing is not None and len(os.listdir(segment_dir)) == 2 and segments.pooled_bytes == 4 << 20
        segments.close()

    loop.run_until_complete(asyncio.wait_for(body(), 20))


def test_segments_of_every_size_class_up_to_a_size_are_made_ahead(loop: asyncio.AbstractEventLoop,
                                                                   segment_dir: Path) -> None:
    """`prefault_up_to` makes one segment per size class from 1 MiB up to the given size's (what a
    decode worker does at start), skips classes already pooled, and stops where the pool is full."""
    segments = shm.Segments(str(segment_dir), pool_bytes=24 << 20)

    def pooled_sizes() -> list[int]:
        return sorted(os.path.getsize(segment_dir / name) >> 20 for name in os.listdir(segment_dir))

    async def body() -> None:
        assert await segments.prefault_up_to(5 << 20) == 4
        assert pooled_sizes() == [1, 2, 4, 8]
        assert await segments.prefault_up_to(3 << 20) == 0  # every class up to 4 MiB is pooled already
        assert await segments.prefault_up_to(40 << 20) == 0  # 16 MiB more would pass the pool's 24
        assert pooled_sizes() == [1, 2, 4, 8]
        landing = await segments.allocate("fe01", 6 << 20)  # takes the pooled 8 MiB one
        assert landing is not None and pooled_sizes() == [1, 2, 4, 8] and segments.pooled_bytes == 7 << 20
        segments.close()

    loop.run_until_complete(asyncio.wait_for(body(), 20))


def test_a_decode_worker_makes_its_landing_segments_at_start(loop: asyncio.AbstractEventLoop, checkpoint: Path,
                                                             segment_dir: Path) -> None:
    """A decode worker on a CPU makes the landing segments of prompts up to one prefill step's tokens
    when it starts (one per size class): its first reservation takes one, it does not wait for a new
    one to be faulted in."""
    from cluster.transfer.ucx import UCXReceiver

    async def body() -> None:
        decode = Worker("decode-0", "decode", make_engine(checkpoint, budget=512),
                        receiver=UCXReceiver(timeout_s=TIMEOUT_S, segment_dir=str(segment_dir)))
        await decode.start()
        try:
            made_at_start = {os.stat(segment_dir / name).st_ino for name in os.listdir(segment_dir)}
            assert made_at_start, "no landing segment was made at start"
            ticket = await decode.reserve("first", [3 + i % 240 for i in range(500)], GREEDY)  # ~a whole step
            assert ticket is not None
            landing = named_for(ticket.landing, segment_dir)
            assert len(landing) == 1 and os.stat(segment_dir / landing[0]).st_ino in made_at_start
            assert len(os.listdir(segment_dir)) == len(made_at_start)  # none made since
        finally:
            await decode.stop()

    loop.run_until_complete(asyncio.wait_for(body(), 60))


def test_the_phase_marks_of_a_frame_line_up_across_both_sides(shm_pair: Pair, segment_dir: Path) -> None:
    """What benchmarks/kv_transfer.py reports per step: every step of an in-place frame is marked on
    its side, in order, and the breakdown has each span."""
    from cluster.transfer.phases import RECEIVER_STEPS, SENDER_STEPS, breakdown

    nbytes = 4 << 20
    shm_pair.sender.phases.on = shm_pair.receiver.phases.on = True

    async def body() -> None:
        landing = await shm_pair.receiver.landing_memory("fd01", nbytes)
        assert landing is not None
        done = shm_pair.receiver.expect("ph", landing, "fd01")
        header = frames("ph", nbytes, "fd01", count=1)[0]
        await shm_pair.sender.send(shm_pair.receiver.address, header, memoryview(payload(nbytes, seed=2)),
                                   shm_pair.receiver.landing_name("fd01"))
        await done

    shm_pair.run(body())
    sender, receiver = shm_pair.sender.phases.marks, shm_pair.receiver.phases.marks
    assert [step for _, step, _ in sender] == list(SENDER_STEPS)
    assert [step for _, step, _ in receiver] == list(RECEIVER_STEPS)
    assert all(earlier[2] <= later[2] for marks in (sender, receiver)
               for earlier, later in zip(marks, marks[1:], strict=False))
    spans = breakdown(sender, receiver, "ph")
    assert {"copy", "marker_wake", "ack_wake", "after_copy", "total"} <= set(spans)
    assert 0 < spans["copy"] < spans["total"]
