"""Both KV connectors, loopback and UCX, against the same contract (see cluster/transfer/connector.py):
payloads land bit for bit in the registered buffer and nowhere else, and everything odd is refused."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import msgpack
import numpy as np
import pytest
import torch

from cluster.transfer.connector import HEADER_VERSION, MAX_HEADER_BYTES, KVHeader, TransferError, TransferState
from cluster.transfer.loopback import FrameRefused, Refusal
from tests.transfer.conftest import Pair

POISON = 0xAB


def header_for(request_id: str, nbytes: int, first_token_id: int = 42) -> KVHeader:
    return KVHeader(request_id=request_id, num_tokens=30, num_blocks=2, block_size=16, num_layers=2,
                    num_kv_heads=3, head_dim=64, dtype="float32", first_token_id=first_token_id, nbytes=nbytes)


def random_payload(nbytes: int, seed: int = 0) -> np.ndarray:
    """Random bytes from a torch tensor, shaped (2, 2, -1) as KV blocks are (the view is cast to bytes)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).reshape(2, 2, -1).numpy()


def poisoned(nbytes: int) -> np.ndarray:
    return np.full(nbytes, POISON, dtype=np.uint8)


def untouched(buffer: np.ndarray) -> bool:
    return bool((buffer == POISON).all())


async def refused_with(pair: Pair, code: Refusal, request_id: str, nbytes: int,
                       payload_nbytes: int | None = None) -> None:
    """Send a frame for `request_id` that must be refused with `code`."""
    payload = random_payload(nbytes if payload_nbytes is None else payload_nbytes, seed=7)
    with pytest.raises(FrameRefused) as refused:
        await pair.sender.send_raw(pair.receiver.address, header_for(request_id, nbytes).to_bytes(),
                                   memoryview(payload))
    assert refused.value.code is code
    assert str(refused.value).startswith(f"refused ({code.name}): ") and not str(refused.value).endswith("None")


@pytest.mark.parametrize("nbytes", [1024, 8 << 20])
def test_payload_lands_bit_for_bit(pair: Pair, nbytes: int) -> None:
    payload, buffer = random_payload(nbytes), poisoned(nbytes)

    async def body() -> None:
        done = pair.receiver.expect("r1", memoryview(buffer))
        assert pair.receiver.state("r1") is TransferState.PENDING
        await pair.sender.send(pair.receiver.address, header_for("r1", nbytes, first_token_id=7), memoryview(payload))
        header = await asyncio.wait_for(done, 5)
        assert header == header_for("r1", nbytes, first_token_id=7)
        assert pair.receiver.state("r1") is TransferState.DONE

    pair.run(body())
    assert np.array_equal(buffer, payload.reshape(-1))


def test_the_payload_is_copied_not_shared(pair: Pair) -> None:
    payload, buffer = random_payload(4096), poisoned(4096)

    async def body() -> None:
        done = pair.receiver.expect("r1", memoryview(buffer))
        await pair.sender.send(pair.receiver.address, header_for("r1", 4096), memoryview(payload))
        await done

    pair.run(body())
    expected = payload.copy()
    payload[:] = 0
    assert np.array_equal(buffer, expected.reshape(-1))


def test_unknown_request_id_is_refused_and_touches_no_buffer(pair: Pair) -> None:
    buffers = {name: poisoned(1024) for name in ("a", "b")}

    async def body() -> None:
        futures = {name: pair.receiver.expect(name, memoryview(buffer)) for name, buffer in buffers.items()}
        await refused_with(pair, Refusal.NOT_EXPECTED, "stranger", 1024)
        assert pair.receiver.state("stranger") is None
        assert not any(future.done() for future in futures.values())
        assert all(pair.receiver.state(name) is TransferState.PENDING for name in buffers)

    pair.run(body())
    assert all(untouched(buffer) for buffer in buffers.values())


@pytest.mark.parametrize("header_nbytes, payload_nbytes", [(2048, 2048), (1024, 512), (1024, 4096)],
                         ids=["header-says-bigger", "payload-shorter", "payload-longer"])
def test_wrong_size_is_refused_and_fails_the_transfer(pair: Pair, header_nbytes: int, payload_nbytes: int) -> None:
    buffer, other = poisoned(1024), poisoned(payload_nbytes)

    async def body() -> None:
        done = pair.receiver.expect("r1", memoryview(buffer))
        bystander = pair.receiver.expect("r2", memoryview(other))
        await refused_with(pair, Refusal.WRONG_SIZE, "r1", header_nbytes, payload_nbytes)
        with pytest.raises(TransferError) as failed:
            await done
        # The failure says which sizes disagreed: the frame's and the buffer's.
        assert str(max(header_nbytes, payload_nbytes)) in str(failed.value) and "1024" in str(failed.value)
        assert pair.receiver.state("r1") is TransferState.FAILED
        assert not bystander.done()

    pair.run(body())
    if header_nbytes != 1024:  # a header-level mismatch is refused before any payload byte lands
        assert untouched(buffer)
    assert untouched(other)


def _valid_header_bytes() -> bytes:
    return header_for("r1", 1024).to_bytes()


BAD_HEADERS = {
    "truncated": (_valid_header_bytes()[:-5], None),
    "garbage": (b"\xc1" * 16, None),
    "over-max": (b"\x00" * (MAX_HEADER_BYTES + 1), None),
    "wrong-types": (msgpack.packb({**msgpack.unpackb(_valid_header_bytes()), "nbytes": "1024"}), None),
    "wrong-version": (msgpack.packb({**msgpack.unpackb(_valid_header_bytes()), "version": 99}), None),
    "extra-field": (msgpack.packb({**msgpack.unpackb(_valid_header_bytes()), "evil": 1}), None),
    "prefix-too-long": (_valid_header_bytes(), len(_valid_header_bytes()) + 10),
    "prefix-too-short": (_valid_header_bytes(), len(_valid_header_bytes()) - 10),
    "prefix-zero": (_valid_header_bytes(), 0),
    "prefix-huge": (_valid_header_bytes(), 1 << 40),
}


@pytest.mark.parametrize("name", list(BAD_HEADERS))
def test_malformed_header_is_refused_and_the_link_stays_usable(pair: Pair, name: str) -> None:
    header_bytes, declared_length = BAD_HEADERS[name]
    buffer, payload = poisoned(1024), random_payload(1024)

    async def body() -> None:
        done = pair.receiver.expect("r1", memoryview(buffer))
        with pytest.raises(FrameRefused) as refused:
            await pair.sender.send_raw(pair.receiver.address, header_bytes, memoryview(random_payload(1024, seed=3)),
                                       declared_length=declared_length)
        assert refused.value.code is Refusal.MALFORMED
        assert not done.done() and untouched(buffer)
        # The same sender (same pooled endpoint for UCX) still delivers a good frame afterwards.
        await pair.sender.send(pair.receiver.address, header_for("r1", 1024), memoryview(payload))
        await asyncio.wait_for(done, 5)

    pair.run(body())
    assert np.array_equal(buffer, payload.reshape(-1))


def test_replay_is_refused(pair: Pair) -> None:
    buffer, first, second = poisoned(1024), random_payload(1024, seed=1), random_payload(1024, seed=2)

    async def body() -> None:
        done = pair.receiver.expect("r1", memoryview(buffer))
        await pair.sender.send(pair.receiver.address, header_for("r1", 1024), memoryview(first))
        await done
        with pytest.raises(FrameRefused) as refused:
            await pair.sender.send(pair.receiver.address, header_for("r1", 1024), memoryview(second))
        assert refused.value.code is Refusal.REPLAY
        assert pair.receiver.state("r1") is TransferState.DONE

    pair.run(body())
    assert np.array_equal(buffer, first.reshape(-1))


@pytest.mark.parametrize("forged", ["", "not-the-token", "t" * 31 + "X"], ids=["none", "other", "one-off"])
def test_a_frame_without_the_transfers_token_is_refused_and_the_transfer_goes_on(pair: Pair, forged: str) -> None:
    """Whoever reaches the receiver's port but lacks the ticket's token cannot land bytes, nor end the
    transfer it targets: the real frames land afterwards."""
    buffer, forged_bytes, real = poisoned(1024), random_payload(1024, seed=1), random_payload(1024, seed=2)
    token = "t" * 32

    async def body() -> None:
        done = pair.receiver.expect("r1", memoryview(buffer), token)
        with pytest.raises(FrameRefused) as refused:
            await pair.sender.send(pair.receiver.address, dataclasses.replace(header_for("r1", 1024), token=forged),
                                   memoryview(forged_bytes))
        assert refused.value.code is Refusal.UNAUTHENTICATED
        assert untouched(buffer) and pair.receiver.state("r1") is TransferState.PENDING
        await pair.sender.send(pair.receiver.address, dataclasses.replace(header_for("r1", 1024), token=token),
                               memoryview(real))
        assert (await done).token == token

    pair.run(body())
    assert np.array_equal(buffer, real.reshape(-1))


def test_a_token_longer_than_the_limit_is_malformed() -> None:
    from cluster.transfer.connector import MAX_TOKEN_CHARS

    header = dataclasses.replace(header_for("r1", 1024), token="x" * MAX_TOKEN_CHARS)
    assert KVHeader.from_bytes(header.to_bytes()) == header
    for token in ("x" * (MAX_TOKEN_CHARS + 1), 7):
        with pytest.raises(TransferError, match="malformed"):
            KVHeader.from_bytes(dataclasses.replace(header, token=token).to_bytes())  # type: ignore[arg-type]


def test_cancel_raises_cancelled_and_refuses_later_frames(pair: Pair) -> None:
    buffer = poisoned(1024)

    async def body() -> None:
        done = pair.receiver.expect("r1", memoryview(buffer))
        pair.receiver.cancel("r1")
        with pytest.raises(asyncio.CancelledError):
            await done
        assert pair.receiver.state("r1") is TransferState.CANCELLED
        await refused_with(pair, Refusal.CANCELLED, "r1", 1024)

    pair.run(body())
    assert untouched(buffer)


def test_a_timed_out_wait_cancels_the_transfer(pair: Pair) -> None:
    buffer = poisoned(1024)

    async def body() -> None:
        done = pair.receiver.expect("r1", memoryview(buffer))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(done, 0.01)
        assert pair.receiver.state("r1") is TransferState.CANCELLED
        await refused_with(pair, Refusal.CANCELLED, "r1", 1024)

    pair.run(body())
    assert untouched(buffer)


def test_an_id_expected_again_right_after_a_cancel_is_not_cancelled_with_it(pair: Pair) -> None:
    buffer, payload = poisoned(1024), random_payload(1024)

    async def body() -> None:
        first = pair.receiver.expect("r1", memoryview(poisoned(1024)))
        pair.receiver.cancel("r1")
        retry = pair.receiver.expect("r1", memoryview(buffer))  # before the cancelled future's callbacks ran
        await asyncio.sleep(0.01)
        assert first.cancelled() and pair.receiver.state("r1") is TransferState.PENDING and not retry.done()
        await pair.sender.send(pair.receiver.address, header_for("r1", 1024), memoryview(payload))
        assert (await asyncio.wait_for(retry, 5)).request_id == "r1"

    pair.run(body())
    assert np.array_equal(buffer, payload.reshape(-1))


def test_cancel_mid_payload_stops_the_bytes(pair: Pair) -> None:
    """Cancel while RECEIVING. Loopback copies in chunks, so the cancel lands mid-copy; UCX in one
    process tends to move the whole payload in one progress call (test_cross_process covers a cancel
    with the bytes half there)."""
    nbytes = 32 << 20
    buffer, payload = poisoned(nbytes), random_payload(nbytes)

    async def cancel_when_receiving() -> None:
        while pair.receiver.state("r1") is not TransferState.RECEIVING:
            await asyncio.sleep(0)
        pair.receiver.cancel("r1")

    async def body() -> None:
        done = pair.receiver.expect("r1", memoryview(buffer))
        canceller = asyncio.ensure_future(cancel_when_receiving())
        with pytest.raises(TransferError):
            await pair.sender.send(pair.receiver.address, header_for("r1", nbytes), memoryview(payload))
        await canceller
        assert done.cancelled()
        assert pair.receiver.state("r1") is TransferState.CANCELLED
        snapshot = buffer.copy()
        await asyncio.sleep(0.1)  # nothing may land after the cancel
        assert np.array_equal(buffer, snapshot)

    pair.run(body())


def test_many_concurrent_transfers_land_in_their_own_buffers(pair: Pair) -> None:
    sizes = [1024 * (1 + (index * 37) % 200) for index in range(16)]
    buffers = [poisoned(size) for size in sizes]
    payloads = [random_payload(size, seed=index) for index, size in enumerate(sizes)]
    second_sender = pair.new_sender()

    async def body() -> None:
        futures = [pair.receiver.expect(f"r{index}", memoryview(buffer)) for index, buffer in enumerate(buffers)]
        sends = [(pair.sender if index % 3 else second_sender).send(
            pair.receiver.address, header_for(f"r{index}", size), memoryview(payload))
            for index, (size, payload) in enumerate(zip(sizes, payloads, strict=True))]
        await asyncio.gather(*sends)
        headers = await asyncio.gather(*futures)
        assert [header.request_id for header in headers] == [f"r{index}" for index in range(16)]
        await second_sender.close()

    pair.run(body())
    for buffer, payload in zip(buffers, payloads, strict=True):
        assert np.array_equal(buffer, payload.reshape(-1))


def test_a_closed_receiver_fails_senders_and_pending_transfers_quickly(pair: Pair) -> None:
    receiver = pair.new_receiver()
    buffer = poisoned(1024)

    async def body() -> None:
        await receiver.start()
        first = receiver.expect("r1", memoryview(buffer))
        await pair.sender.send(receiver.address, header_for("r1", 1024), memoryview(random_payload(1024)))
        await first
        pending = receiver.expect("r2", memoryview(poisoned(1024)))
        await receiver.close()
        with pytest.raises(TransferError):
            await pending
        started = time.perf_counter()
        # The sender holds a pooled endpoint to it (UCX): the dead link must fail, not hang.
        with pytest.raises(TransferError):
            await pair.sender.send(receiver.address, header_for("r3", 1024), memoryview(random_payload(1024)))
        assert time.perf_counter() - started < 2.0
        with pytest.raises(TransferError):
            receiver.expect("r4", memoryview(poisoned(1024)))

    pair.run(body())


def test_sending_to_nobody_fails_quickly(pair: Pair) -> None:
    address = "loopback://nobody" if pair.kind == "loopback" else "ucx://127.0.0.1:1"

    async def body() -> None:
        started = time.perf_counter()
        with pytest.raises(TransferError):
            await pair.sender.send(address, header_for("r1", 1024), memoryview(random_payload(1024)))
        assert time.perf_counter() - started < 2.0

    pair.run(body())


def test_expect_validates_its_arguments(pair: Pair) -> None:
    async def body() -> None:
        pair.receiver.expect("r1", memoryview(poisoned(16)))
        with pytest.raises(ValueError, match="already expected"):
            pair.receiver.expect("r1", memoryview(poisoned(16)))
        with pytest.raises(ValueError, match="read-only"):
            pair.receiver.expect("r2", memoryview(bytes(16)))
        with pytest.raises(ValueError, match="contiguous"):
            pair.receiver.expect("r3", memoryview(poisoned(32))[::2])

    pair.run(body())


def test_send_refuses_a_payload_that_disagrees_with_its_header(pair: Pair) -> None:
    async def body() -> None:
        with pytest.raises(ValueError, match="header says"):
            await pair.sender.send(pair.receiver.address, header_for("r1", 1024), memoryview(random_payload(512)))

    pair.run(body())


def frame_header(request_id: str, first_block: int, num_blocks: int, last: bool, block_nbytes: int = 512) -> KVHeader:
    """A frame of a 4-block transfer (num_tokens 60, block_size 16): blocks [first, first + num)."""
    return KVHeader(request_id=request_id, num_tokens=60, num_blocks=num_blocks, block_size=16, num_layers=2,
                    num_kv_heads=1, head_dim=4, dtype="float32", first_token_id=9 if last else 0,
                    nbytes=num_blocks * block_nbytes, first_block=first_block, last=last)


def test_frames_land_in_order_at_their_offsets(pair: Pair) -> None:
    payload, buffer = random_payload(4 * 512), poisoned(4 * 512)
    flat = payload.reshape(-1)

    async def body() -> None:
        done = pair.receiver.expect("multi", memoryview(buffer))
        for first, count, last in [(0, 1, False), (1, 2, False), (3, 1, True)]:
            assert not done.done()
            frame = np.ascontiguousarray(flat[first * 512:(first + count) * 512])
            await pair.sender.send(pair.receiver.address, frame_header("multi", first, count, last),
                                   memoryview(frame))
            if not last:
                assert pair.receiver.state("multi") is TransferState.PARTIAL
        header = await asyncio.wait_for(done, 5)
        assert header.last and header.first_token_id == 9
        assert np.array_equal(buffer, flat)

    pair.run(body())


@pytest.mark.parametrize("frames", [[(1, 1, False)], [(0, 1, False), (0, 1, False)]], ids=["gap", "repeat"])
def test_a_frame_out_of_place_fails_the_transfer(pair: Pair, frames: list[tuple[int, int, bool]]) -> None:
    buffer = poisoned(4 * 512)

    async def body() -> None:
        done = pair.receiver.expect("odd", memoryview(buffer))
        *good, (first, count, last) = frames
        for frame in good:
            await pair.sender.send(pair.receiver.address, frame_header("odd", *frame), memoryview(poisoned(512)))
        with pytest.raises(FrameRefused) as refused:
            await pair.sender.send(pair.receiver.address, frame_header("odd", first, count, last),
                                   memoryview(random_payload(count * 512)))
        assert refused.value.code is Refusal.WRONG_SIZE
        with pytest.raises(TransferError):
            await asyncio.wait_for(done, 5)
        assert pair.receiver.state("odd") is TransferState.FAILED

    pair.run(body())


def test_a_frame_past_the_buffer_end_is_refused_though_not_the_last(pair: Pair) -> None:
    buffer = poisoned(4 * 512)

    async def body() -> None:
        done = pair.receiver.expect("big", memoryview(buffer))
        # Three blocks of 1,024 bytes: a valid header (not yet the last block), but 3,072 bytes for 2,048.
        with pytest.raises(FrameRefused) as refused:
            await pair.sender.send(pair.receiver.address, frame_header("big", 0, 3, False, block_nbytes=1024),
                                   memoryview(random_payload(3 * 1024)))
        assert refused.value.code is Refusal.WRONG_SIZE
        with pytest.raises(TransferError):
            await asyncio.wait_for(done, 5)
        assert pair.receiver.state("big") is TransferState.FAILED

    pair.run(body())
    assert untouched(buffer)


def test_cancel_between_frames_refuses_the_rest(pair: Pair) -> None:
    buffer = poisoned(4 * 512)

    async def body() -> None:
        done = pair.receiver.expect("half", memoryview(buffer))
        await pair.sender.send(pair.receiver.address, frame_header("half", 0, 2, False),
                               memoryview(random_payload(1024)))
        pair.receiver.cancel("half")
        with pytest.raises(asyncio.CancelledError):
            await done
        with pytest.raises(FrameRefused) as refused:
            await pair.sender.send(pair.receiver.address, frame_header("half", 2, 2, True),
                                   memoryview(random_payload(1024)))
        assert refused.value.code is Refusal.CANCELLED
        assert untouched(buffer[1024:])

    pair.run(body())


TYPES, BLOCKS, TOKENS, LAYOUT = ("wrong field types", "a frame holds a whole number of blocks, at least one",
                                 "no tokens", "the blocks do not match the tokens")


# Each field alone at its bad value, every other field valid (the current version included), so that
# one check cannot hide behind another; the reason is logged by the receiver, so it must name the problem.
@pytest.mark.parametrize("fields, reason", [
    ({"first_block": 3, "num_blocks": 1, "last": False}, LAYOUT),  # the last block, not last
    ({"first_block": 0, "num_blocks": 3, "nbytes": 3 * 512, "last": True}, LAYOUT),  # last, short of the end
    ({"first_block": 1, "num_blocks": 4, "last": True}, LAYOUT),  # past the end
    ({"num_tokens": 2**62}, LAYOUT),
    ({"num_tokens": 0}, TOKENS), ({"block_size": 0}, TOKENS),
    ({"num_blocks": 0}, BLOCKS), ({"num_blocks": 0, "nbytes": 0}, BLOCKS), ({"nbytes": 2049}, BLOCKS),
    ({"nbytes": 4097}, BLOCKS),
    ({"last": 1}, TYPES), ({"last": "yes"}, TYPES), ({"request_id": 7}, TYPES), ({"dtype": None}, TYPES),
    ({"token": 7}, TYPES),
    # Hostile but well-formed: negative, wrong types.
    ({"num_blocks": -1}, TYPES), ({"num_tokens": -5}, TYPES), ({"first_block": -1}, TYPES), ({"nbytes": -4096}, TYPES),
    ({"num_layers": -2}, TYPES), ({"head_dim": 1.5}, TYPES), ({"first_token_id": -1}, TYPES),
    ({"num_kv_heads": True}, TYPES), ({"nbytes": "4096"}, TYPES),
    ({"unexpected": 1}, "unexpected"),
], ids=lambda value: ",".join(f"{key}={field}" for key, field in value.items()) if isinstance(value, dict) else "")
def test_inconsistent_frame_headers_are_malformed(fields: dict[str, object], reason: str) -> None:
    data = msgpack.packb({"version": HEADER_VERSION, **dataclasses.asdict(frame_header("h", 0, 4, True)), **fields})
    with pytest.raises(TransferError, match=rf"^malformed header: .*{re.escape(reason)}"):
        KVHeader.from_bytes(data)


@pytest.mark.parametrize("num_tokens, block_size, first_block, num_blocks", [
    (1, 16, 0, 1), (16, 16, 0, 1), (17, 16, 0, 2), (32, 16, 1, 1), (33, 16, 2, 1),
    (1, 1, 0, 1), (5, 1, 4, 1), (5, 1, 0, 5),  # a block of one token
])
def test_headers_at_block_boundaries_are_accepted(num_tokens: int, block_size: int, first_block: int,
                                                  num_blocks: int) -> None:
    header = dataclasses.replace(frame_header("b", first_block, num_blocks, True), num_tokens=num_tokens,
                                 block_size=block_size)
    assert KVHeader.from_bytes(header.to_bytes()) == header


def test_a_header_without_its_version_is_malformed() -> None:
    fields = dataclasses.asdict(frame_header("v", 0, 4, True))
    for data in (msgpack.packb(fields), msgpack.packb({"version": HEADER_VERSION - 1, **fields}),
                 msgpack.packb([1, 2])):
        with pytest.raises(TransferError, match=rf"^malformed header: not a version-{HEADER_VERSION} KV header$"):
            KVHeader.from_bytes(data)


def test_headers_up_to_the_size_limit_are_read_and_larger_ones_refused() -> None:
    from cluster.transfer.connector import MAX_HEADER_BYTES

    base = len(frame_header("", 0, 4, True).to_bytes())
    # msgpack writes a str of 256+ characters with 3 bytes of length (1 for the empty id): the id
    # makes the header exactly the limit.
    exact = frame_header("x" * (MAX_HEADER_BYTES - base - 2), 0, 4, True)
    assert len(exact.to_bytes()) == MAX_HEADER_BYTES
    assert KVHeader.from_bytes(exact.to_bytes()).request_id == exact.request_id
    data = msgpack.packb({"version": HEADER_VERSION,
                         **dataclasses.asdict(dataclasses.replace(exact, request_id="x" * 5000))})
    with pytest.raises(TransferError, match=rf"^header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}$"):
        KVHeader.from_bytes(data)


def test_bytes_that_are_no_header_are_malformed_and_an_oversized_header_is_not_sent() -> None:
    for garbage in (b"\xc1", b"\x92\x01", b"", b"\xdc\xff"):
        with pytest.raises(TransferError, match=r"^malformed header: "):
            KVHeader.from_bytes(garbage)
    with pytest.raises(TransferError, match=r"^header of \d+ bytes exceeds 4096$"):
        dataclasses.replace(frame_header("x", 0, 4, True), request_id="x" * 5000).to_bytes()
