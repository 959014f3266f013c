"""The loopback connector's failure injection, which the engine's failure-path tests rely on."""

from __future__ import annotations

import asyncio

import pytest

from cluster.transfer.connector import TransferError, TransferState
from cluster.transfer.loopback import FailMode, FrameRefused, LoopbackHub, LoopbackReceiver, LoopbackSender, Refusal
from tests.transfer.test_connectors import header_for, poisoned, random_payload, untouched

NBYTES = 8 << 20  # two copy chunks


def run(hub: LoopbackHub, test: object) -> None:
    async def body() -> None:
        receiver, sender = LoopbackReceiver(hub, "d"), LoopbackSender(hub, timeout_s=0.5)
        await receiver.start()
        await test(receiver, sender)  # type: ignore[operator]
        await receiver.close()

    asyncio.run(body())


def test_unreachable_touches_nothing() -> None:
    hub, buffer = LoopbackHub(), poisoned(NBYTES)

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        done = receiver.expect("r1", memoryview(buffer))
        hub.fail_next(1, FailMode.UNREACHABLE)
        with pytest.raises(TransferError, match="unreachable"):
            await sender.send(receiver.address, header_for("r1", NBYTES), memoryview(random_payload(NBYTES)))
        assert not done.done() and hub.frames == 0
        # Only the next send fails: a retry goes through.
        await sender.send(receiver.address, header_for("r1", NBYTES), memoryview(random_payload(NBYTES)))
        await done

    run(hub, test)


def test_peer_lost_fails_both_sides_midway() -> None:
    hub, buffer = LoopbackHub(), poisoned(NBYTES)

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        done = receiver.expect("r1", memoryview(buffer))
        hub.fail_next(1, FailMode.PEER_LOST)
        with pytest.raises(TransferError, match="lost"):
            await sender.send(receiver.address, header_for("r1", NBYTES), memoryview(random_payload(NBYTES)))
        with pytest.raises(TransferError, match="peer lost"):
            await done
        assert receiver.state("r1") is TransferState.FAILED

    run(hub, test)
    assert not untouched(buffer[: NBYTES // 2]) and untouched(buffer[NBYTES // 2:])


def test_ack_lost_lands_the_payload_but_fails_the_sender() -> None:
    hub, buffer, payload = LoopbackHub(), poisoned(1024), random_payload(1024)

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        done = receiver.expect("r1", memoryview(buffer))
        hub.fail_next(1, FailMode.ACK_LOST, address=receiver.address)
        with pytest.raises(TransferError, match="ack"):
            await sender.send(receiver.address, header_for("r1", 1024), memoryview(payload))
        assert (await done).request_id == "r1"

    run(hub, test)
    assert (buffer == payload.reshape(-1)).all()


def test_corrupt_header_is_refused_as_malformed() -> None:
    hub, buffer = LoopbackHub(), poisoned(1024)

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        done = receiver.expect("r1", memoryview(buffer))
        hub.fail_next(1, FailMode.CORRUPT_HEADER)
        with pytest.raises(FrameRefused) as refused:
            await sender.send(receiver.address, header_for("r1", 1024), memoryview(random_payload(1024)))
        assert refused.value.code is Refusal.MALFORMED and not done.done()

    run(hub, test)
    assert untouched(buffer)


def test_failures_can_target_one_address() -> None:
    hub = LoopbackHub()

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        hub.fail_next(1, FailMode.UNREACHABLE, address="loopback://elsewhere")
        done = receiver.expect("r1", memoryview(poisoned(1024)))
        await sender.send(receiver.address, header_for("r1", 1024), memoryview(random_payload(1024)))
        await done
        assert hub.take_failure("loopback://elsewhere") is FailMode.UNREACHABLE

    run(hub, test)


def test_latency_beyond_the_sender_deadline_is_a_transfer_error() -> None:
    hub = LoopbackHub(latency_s=2.0)

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        done = receiver.expect("r1", memoryview(poisoned(1024)))
        with pytest.raises(TransferError, match="timed out"):
            await sender.send(receiver.address, header_for("r1", 1024), memoryview(random_payload(1024)))
        assert not done.done()

    run(hub, test)


def test_a_closed_sender_refuses_to_send() -> None:
    hub = LoopbackHub()

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        await sender.close()
        with pytest.raises(TransferError, match="closed"):
            await sender.send(receiver.address, header_for("r1", 1024), memoryview(random_payload(1024)))

    run(hub, test)


def test_the_hub_counts_every_frame_that_reaches_a_receiver_and_fail_next_fails_one() -> None:
    hub = LoopbackHub()

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        for index in range(3):
            done = receiver.expect(f"r{index}", memoryview(poisoned(NBYTES)))
            await sender.send(receiver.address, header_for(f"r{index}", NBYTES), memoryview(random_payload(NBYTES)))
            await done
        assert hub.frames == 3
        hub.fail_next()  # one send, by default
        receiver.expect("x", memoryview(poisoned(NBYTES)))
        with pytest.raises(TransferError):
            await sender.send(receiver.address, header_for("x", NBYTES), memoryview(random_payload(NBYTES)))
        await sender.send(receiver.address, header_for("x", NBYTES), memoryview(random_payload(NBYTES)))
        assert hub.frames == 4
        with pytest.raises(TransferError, match=r"^no receiver at loopback://nobody$"):
            hub.lookup("loopback://nobody")

    run(hub, test)


def test_failing_or_cancelling_an_unknown_transfer_is_harmless() -> None:
    from cluster.transfer.loopback import ReceiveTable

    async def body() -> None:
        table = ReceiveTable()
        table.fail("unknown", TransferError("gone"))
        table.cancel("unknown")
        assert table.state("unknown") is None

    asyncio.run(body())


def test_the_hub_keeps_one_receiver_per_address() -> None:
    async def body() -> None:
        hub = LoopbackHub()
        first, second = LoopbackReceiver(hub, "same"), LoopbackReceiver(hub, "same")
        await first.start()
        with pytest.raises(ValueError, match=r"^loopback://same is already registered$"):
            await second.start()
        hub.unregister(second)  # not the registered one: nothing changes
        assert hub.lookup("loopback://same") is first
        await first.start()  # started already: no second registration
        await first.close()
        with pytest.raises(TransferError, match=r"^no receiver at loopback://same$"):
            hub.lookup("loopback://same")

    asyncio.run(body())


def test_finished_ids_are_remembered_up_to_the_bound_then_forgotten_oldest_first() -> None:
    from cluster.transfer.connector import TransferState
    from cluster.transfer.loopback import ReceiveTable

    async def body() -> None:
        table = ReceiveTable(remember=2)
        for name in ("a", "b", "c"):
            table.expect(name, memoryview(bytearray(8)))
            table.cancel(name)
        assert table.state("a") is None  # forgotten: the oldest went first
        assert table.state("b") is TransferState.CANCELLED and table.state("c") is TransferState.CANCELLED

    asyncio.run(body())


def test_a_closed_receiver_fails_its_transfers_saying_so_and_senders_stay_closed() -> None:
    async def body() -> None:
        hub = LoopbackHub()
        receiver, sender = LoopbackReceiver(hub, "d"), LoopbackSender(hub)
        await receiver.start()
        pending = receiver.expect("r", memoryview(poisoned(NBYTES)))
        await receiver.close()
        with pytest.raises(TransferError, match=r"^receiver loopback://d closed$"):
            await pending
        await sender.close()
        with pytest.raises(TransferError, match=r"^the sender is closed$"):
            await sender.send(receiver.address, header_for("r", NBYTES), memoryview(random_payload(NBYTES)))

    asyncio.run(body())


def test_buffers_of_any_shape_and_format_are_seen_as_flat_bytes() -> None:
    import numpy as np

    from cluster.transfer.loopback import readable_bytes, writable_bytes

    for array in (np.zeros((4, 8), dtype=np.float32), np.zeros(16, dtype=np.uint16), np.zeros(32, dtype=np.uint8)):
        for view in (readable_bytes(memoryview(array)), writable_bytes(memoryview(array))):
            assert view.format == "B" and view.ndim == 1 and view.nbytes == array.nbytes
    strided = np.zeros((4, 8), dtype=np.uint8)[:, ::2]
    with pytest.raises(ValueError, match=r"^the payload is not C-contiguous$"):
        readable_bytes(memoryview(strided))
    with pytest.raises(ValueError, match=r"^the receive buffer is not C-contiguous$"):
        writable_bytes(memoryview(strided))
    with pytest.raises(ValueError, match=r"^the receive buffer is read-only$"):
        writable_bytes(memoryview(bytes(8)))
