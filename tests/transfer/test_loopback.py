"""The loopback connector's failure injection, which the engine's failure-path tests rely on."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.transfer.connector import KVHeader, TransferError, TransferState
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
    hub, buffer, payload = LoopbackHub(), poisoned(NBYTES), random_payload(NBYTES)

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        done = receiver.expect("r1", memoryview(buffer))
        hub.fail_next(1, FailMode.PEER_LOST)
        with pytest.raises(TransferError, match="lost"):
            await sender.send(receiver.address, header_for("r1", NBYTES), memoryview(payload))
        with pytest.raises(TransferError, match="peer lost"):
            await done
        assert receiver.state("r1") is TransferState.FAILED

    run(hub, test)
    # Exactly the first half landed, as `FailMode.PEER_LOST` promises.
    assert (buffer[: NBYTES // 2] == payload.reshape(-1)[: NBYTES // 2]).all() and untouched(buffer[NBYTES // 2:])


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
        with pytest.raises(TransferError, match="receiver is closed"):
            receiver.expect("later", memoryview(poisoned(NBYTES)))
        await sender.close()
        with pytest.raises(TransferError, match=r"^the sender is closed$"):
            await sender.send(receiver.address, header_for("r", NBYTES), memoryview(random_payload(NBYTES)))

    asyncio.run(body())


def test_buffers_of_any_shape_and_format_are_seen_as_flat_bytes() -> None:
    import numpy as np

    from cluster.transfer.loopback import readable_bytes, writable_bytes

    arrays = (np.zeros((4, 8), dtype=np.float32), np.zeros(16, dtype=np.uint16), np.zeros(32, dtype=np.uint8),
              np.zeros((4, 8), dtype=np.uint8), np.zeros(32, dtype=np.int8))
    for array in arrays:
        for view in (readable_bytes(memoryview(array)), writable_bytes(memoryview(array))):
            assert view.format == "B" and view.ndim == 1 and view.nbytes == array.nbytes
    strided = np.zeros((4, 8), dtype=np.uint8)[:, ::2]
    with pytest.raises(ValueError, match=r"^the payload is not C-contiguous$"):
        readable_bytes(memoryview(strided))
    with pytest.raises(ValueError, match=r"^the receive buffer is not C-contiguous$"):
        writable_bytes(memoryview(strided))
    with pytest.raises(ValueError, match=r"^the receive buffer is read-only$"):
        writable_bytes(memoryview(bytes(8)))


def test_the_receive_table_says_which_request_it_refuses_and_why() -> None:
    from cluster.transfer.loopback import ReceiveTable

    def refusal(table: ReceiveTable, header: KVHeader) -> FrameRefused:
        with pytest.raises(FrameRefused) as refused:
            table.admit(header)
        return refused.value

    async def body() -> None:
        table = ReceiveTable()
        refused = refusal(table, header_for("stranger", 1024))
        assert refused.code is Refusal.NOT_EXPECTED and "'stranger'" in str(refused)
        done = table.expect("landed", memoryview(poisoned(1024)))
        table.admit(header_for("landed", 1024))
        refused = refusal(table, header_for("landed", 1024))
        assert refused.code is Refusal.BUSY and "'landed'" in str(refused)
        table.complete(header_for("landed", 1024))
        await done
        refused = refusal(table, header_for("landed", 1024))
        assert refused.code is Refusal.REPLAY and "'landed'" in str(refused) and "DONE" in str(refused)
        table.expect("dropped", memoryview(poisoned(1024)))
        table.cancel("dropped")
        refused = refusal(table, header_for("dropped", 1024))
        assert refused.code is Refusal.CANCELLED and "'dropped'" in str(refused)
        table.expect("small", memoryview(poisoned(512)))
        refused = refusal(table, header_for("small", 1024))
        assert refused.code is Refusal.WRONG_SIZE and all(text in str(refused) for text in ("'small'", "1024", "512"))
        # The receiver logs the reason: it names the request and the token, never the token itself.
        table.expect("guarded", memoryview(poisoned(1024)), "s" * 32)
        refused = refusal(table, dataclasses.replace(header_for("guarded", 1024), token="forged"))
        assert refused.code is Refusal.UNAUTHENTICATED and "'guarded'" in str(refused) and "token" in str(refused)
        assert "s" * 32 not in str(refused) and "forged" not in str(refused)

    asyncio.run(body())


def test_a_second_frame_while_one_lands_is_refused_busy_and_the_first_lands() -> None:
    hub, buffer, payload = LoopbackHub(), poisoned(NBYTES), random_payload(NBYTES)

    async def test(receiver: LoopbackReceiver, sender: LoopbackSender) -> None:
        done = receiver.expect("r1", memoryview(buffer))
        first = asyncio.ensure_future(sender.send(receiver.address, header_for("r1", NBYTES), memoryview(payload)))
        while receiver.state("r1") is not TransferState.RECEIVING:
            await asyncio.sleep(0)
        with pytest.raises(FrameRefused) as refused:
            await sender.send(receiver.address, header_for("r1", NBYTES), memoryview(random_payload(NBYTES, seed=1)))
        assert refused.value.code is Refusal.BUSY
        await first
        await done

    run(hub, test)
    assert (buffer == payload.reshape(-1)).all()


def test_cancelling_a_transfer_whose_payload_arrives_stops_its_carrier_and_only_then() -> None:
    from cluster.transfer.loopback import ReceiveTable

    async def body() -> None:
        stopped: list[str] = []
        table = ReceiveTable(on_stop=stopped.append)
        table.expect("waiting", memoryview(poisoned(1024)))
        table.cancel("waiting")  # nothing arriving: no carrier to stop
        assert stopped == []
        table.expect("arriving", memoryview(poisoned(1024)))
        table.admit(header_for("arriving", 1024))
        table.cancel("arriving")
        assert stopped == ["arriving"] and table.state("arriving") is TransferState.CANCELLED

    asyncio.run(body())


def test_an_id_expected_again_is_remembered_from_its_last_finish() -> None:
    from cluster.transfer.loopback import ReceiveTable

    async def body() -> None:
        table = ReceiveTable(remember=2)
        for name in ("a", "b", "a", "c"):  # "a" retried after "b": "b" is now the oldest finished id
            table.expect(name, memoryview(bytearray(8)))
            table.cancel(name)
        assert table.state("b") is None
        assert table.state("a") is TransferState.CANCELLED and table.state("c") is TransferState.CANCELLED

    asyncio.run(body())


def test_transfers_abandoned_at_close_and_finished_ones_raise_no_event_loop_errors() -> None:
    import gc

    async def body() -> None:
        errors: list[dict[str, object]] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        hub = LoopbackHub()
        receiver, sender = LoopbackReceiver(hub, "d"), LoopbackSender(hub)
        await receiver.start()
        done = receiver.expect("landed", memoryview(poisoned(1024)))
        await sender.send(receiver.address, header_for("landed", 1024), memoryview(random_payload(1024)))
        await done
        receiver.expect("abandoned", memoryview(poisoned(1024)))  # nobody awaits it
        await receiver.close()
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()  # an exception never retrieved is reported when its future is collected
        assert errors == []

    asyncio.run(body())
