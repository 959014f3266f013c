"""An in-process KV connector (asyncio, no network) with failure injection, for tests.

`LoopbackHub` stands for the network: receivers register under a name ("loopback://<name>"),
senders look them up. A send validates and refuses frames exactly as the UCX connector does (both
use `ReceiveTable`), then copies the payload into the registered buffer: a real copy, so a test that
mutates the source afterwards sees what a remote receiver would. `hub.fail_next(...)` makes the next
sends fail in the ways a network fails, so the engine's failure paths can be tested without one:

    hub = LoopbackHub()
    receiver = LoopbackReceiver(hub, "decode-0"); await receiver.start()
    sender = LoopbackSender(hub)
    hub.fail_next(1, FailMode.PEER_LOST)   # the next send breaks mid-payload
    done = receiver.expect("r1", buffer)
    await sender.send(receiver.address, header, payload)   # raises TransferError; `done` too

`ReceiveTable` (the bookkeeping of expected transfers, their states and the refusal rules) lives here
and is shared with `cluster.transfer.ucx`, so the two cannot disagree on what is refused.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from cluster.transfer.connector import DeviceBytes, KVBytes, KVHeader, TransferError, TransferState

log = logging.getLogger(__name__)

LOOPBACK_SCHEME = "loopback://"
# The copy yields to the event loop between chunks, so a cancel can land mid-payload as on a network.
COPY_CHUNK_BYTES = 4 << 20
# Finished ids remembered to refuse replays; the oldest are forgotten first.
REMEMBERED_IDS = 65536


class Refusal(enum.IntEnum):
    """The receiver's verdict on a frame: the 1-byte ack of the UCX wire format (0 = landed)."""

    OK = 0
    NOT_EXPECTED = 1  # no `expect` for this request id
    WRONG_SIZE = 2  # header or payload size differs from the registered buffer
    MALFORMED = 3  # header unreadable, too long, or invalid
    REPLAY = 4  # the id already finished (DONE or FAILED)
    CANCELLED = 5  # the id was cancelled, before or during the payload
    BUSY = 6  # a payload for this id is being received right now
    FAILED = 7  # the receiver could not land the payload (timeout, closing)
    UNAUTHENTICATED = 8  # the header's token is not the one the transfer was expected with


class FrameRefused(TransferError):
    """Raised by `ReceiveTable.admit` (receiver side) and by senders when the receiver refused."""

    def __init__(self, code: Refusal, reason: str) -> None:
        super().__init__(f"refused ({code.name}): {reason}")
        self.code = code


def is_device_bytes(buffer: object) -> bool:
    """Whether `buffer` lives in GPU memory (it has a `__cuda_array_interface__`)."""
    return hasattr(buffer, "__cuda_array_interface__")


def device_bytes(buffer: DeviceBytes, writable: bool) -> DeviceBytes:
    """`buffer` itself if it is flat device bytes (1-D, uint8, contiguous; writable if asked), else
    ValueError: UCX sends and receives device memory as one contiguous region."""
    interface = buffer.__cuda_array_interface__
    if interface.get("typestr") != "|u1" or len(interface.get("shape", ())) != 1 \
            or interface.get("strides") not in (None, (1,)):
        raise ValueError(f"a device buffer must be flat bytes (1-D uint8, contiguous), not {interface!r}")
    if writable and interface["data"][1]:
        raise ValueError("the receive buffer is read-only")
    return buffer


def writable_bytes(buffer: KVBytes) -> KVBytes:
    """A flat byte view of a registered buffer; raises ValueError unless writable and C-contiguous."""
    if is_device_bytes(buffer):
        return device_bytes(buffer, writable=True)  # type: ignore[arg-type]
    view = memoryview(buffer)  # type: ignore[arg-type]
    if view.readonly:
        raise ValueError("the receive buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("the receive buffer is not C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def checked_payload(header: KVHeader, payload: KVBytes) -> KVBytes:
    """The payload as bytes, refusing to send one whose size differs from what its header says."""
    view = readable_bytes(payload)
    if view.nbytes != header.nbytes:
        raise ValueError(f"payload of {view.nbytes} bytes, header says {header.nbytes}")
    return view


def readable_bytes(payload: KVBytes) -> KVBytes:
    """A flat byte view of a payload; raises ValueError unless C-contiguous."""
    if is_device_bytes(payload):
        return device_bytes(payload, writable=False)  # type: ignore[arg-type]
    view = memoryview(payload)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise ValueError("the payload is not C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def host_only(buffer: KVBytes) -> memoryview:
    """`buffer` as host bytes; ValueError for device memory (the loopback connector copies with
    memoryviews)."""
    if is_device_bytes(buffer):
        raise ValueError("the loopback connector carries host memory only, not GPU memory")
    return buffer  # type: ignore[return-value]


@dataclass(slots=True)
class _Slot:
    buffer: KVBytes
    future: asyncio.Future[KVHeader]
    state: TransferState
    landed: int = 0  # bytes of the frames landed so far (frames arrive in order)
    frame: KVBytes | None = None  # the part of `buffer` the frame being received fills
    token: str = ""  # what every frame's header must carry


class ReceiveTable:
    """Expected transfers of one receiver: their buffers, futures and states, and the refusal rules.

    Used by both receivers from their event loop (not thread-safe). Buffers are held only while a
    transfer is PENDING or RECEIVING; finished ids keep just their state, to refuse replays.
    `on_stop(request_id)` is called when a cancel hits a transfer whose payload is arriving: the
    receiver must stop its carrier there, or bytes would keep landing in the buffer.
    """

    def __init__(self, remember: int = REMEMBERED_IDS, on_stop: Callable[[str], None] | None = None) -> None:
        self._on_stop = on_stop
        self._slots: dict[str, _Slot] = {}
        self._finished: OrderedDict[str, TransferState] = OrderedDict()
        self._remember = remember
        self._closed = False

    def expect(self, request_id: str, buffer: KVBytes, token: str = "") -> asyncio.Future[KVHeader]:
        """Register `buffer` for `request_id`, whose frames must carry `token` (called by the
        receiver's `expect`, in its event loop).

        Raises ValueError for an id already pending or receiving, or an unusable buffer, and
        TransferError once closed. An id that finished may be expected again (a deliberate retry).
        Cancelling the returned future (e.g. `asyncio.wait_for` timing out) cancels the transfer
        too, one event-loop step later (a done-callback); `cancel` acts at once.
        """
        if self._closed:
            raise TransferError("the receiver is closed")
        if request_id in self._slots:
            raise ValueError(f"request {request_id!r} is already expected")
        future: asyncio.Future[KVHeader] = asyncio.get_running_loop().create_future()
        self._slots[request_id] = _Slot(writable_bytes(buffer), future, TransferState.PENDING, token=token)
        self._finished.pop(request_id, None)
        future.add_done_callback(lambda done: self._on_future_done(request_id, done))
        return future

    def state(self, request_id: str) -> TransferState | None:
        slot = self._slots.get(request_id)
        return slot.state if slot is not None else self._finished.get(request_id)

    def admit(self, header: KVHeader) -> KVBytes:
        """Accept a frame whose header was read (called by a receiver before the payload).

        Returns the part of the registered buffer the frame fills and marks the id RECEIVING, or
        raises FrameRefused. A frame that does not fit where the previous one ended (or that ends the
        transfer short of the buffer's end) also fails the expected transfer: the sender and the
        receiver disagree on the layout, and the payload cannot be trusted.
        """
        slot = self._slots.get(header.request_id)
        if slot is None:
            raise self._refusal_for_unknown(header.request_id)
        # Refused without failing the transfer: whoever forges frames must not be able to cancel it.
        if not hmac.compare_digest(header.token.encode(), slot.token.encode()):
            raise FrameRefused(Refusal.UNAUTHENTICATED, f"request {header.request_id!r}: the frame's token is "
                                                        "not the transfer's")
        if slot.state is TransferState.RECEIVING:
            raise FrameRefused(Refusal.BUSY, f"request {header.request_id!r} is already receiving")
        start = header.first_block * header.block_nbytes
        stop = start + header.nbytes
        if start != slot.landed or stop > slot.buffer.nbytes or (header.last and stop != slot.buffer.nbytes):
            reason = (f"request {header.request_id!r}: frame of bytes [{start}, {stop}){' (last)' * header.last}"
                      f" after {slot.landed} landed, buffer holds {slot.buffer.nbytes}")
            self.fail(header.request_id, FrameRefused(Refusal.WRONG_SIZE, reason))
            raise FrameRefused(Refusal.WRONG_SIZE, reason)
        slot.state = TransferState.RECEIVING
        slot.frame = slot.buffer[start:stop]
        return slot.frame

    def _refusal_for_unknown(self, request_id: str) -> FrameRefused:
        finished = self._finished.get(request_id)
        if finished is TransferState.CANCELLED:
            return FrameRefused(Refusal.CANCELLED, f"request {request_id!r} was cancelled")
        if finished is not None:
            return FrameRefused(Refusal.REPLAY, f"request {request_id!r} already finished ({finished.name})")
        return FrameRefused(Refusal.NOT_EXPECTED, f"request {request_id!r} is not expected")

    def complete(self, header: KVHeader) -> None:
        """The payload of `header` is in place (called by the receiver): resolve the future on the
        last frame, else wait for the next one."""
        slot = self._slots.get(header.request_id)
        if slot is None:
            return
        slot.landed += header.nbytes
        slot.state, slot.frame = TransferState.PARTIAL, None
        if header.last:
            self._finish(header.request_id, TransferState.DONE)
            if not slot.future.done():
                slot.future.set_result(header)

    def fail(self, request_id: str, error: TransferError) -> None:
        """The transfer cannot complete (wrong size, peer lost, timeout): fail its future."""
        slot = self._finish(request_id, TransferState.FAILED)
        if slot is not None and not slot.future.done():
            slot.future.set_exception(error)

    def cancel(self, request_id: str) -> None:
        """Cancel a pending or receiving transfer (its future raises CancelledError); a receiving
        one has its carrier stopped through `on_stop` before this returns."""
        slot = self._finish(request_id, TransferState.CANCELLED)
        if slot is None:
            return
        if slot.state is TransferState.RECEIVING and self._on_stop is not None:
            self._on_stop(request_id)
        if not slot.future.done():
            slot.future.cancel()

    def is_live(self, request_id: str, frame: KVBytes) -> bool:
        """Whether `frame` (from `admit`) is still being received for `request_id` (not cancelled)."""
        slot = self._slots.get(request_id)
        return slot is not None and slot.frame is frame and slot.state is TransferState.RECEIVING

    def close(self, error: TransferError) -> None:
        """Fail every pending transfer (the receiver is closing) and refuse new expectations."""
        self._closed = True
        for request_id in list(self._slots):
            future = self._slots[request_id].future
            self.fail(request_id, error)
            # Nobody may await a transfer abandoned at shutdown: no "exception never retrieved" log.
            future.add_done_callback(_mark_retrieved)

    def _finish(self, request_id: str, state: TransferState) -> _Slot | None:
        """Drop the slot (its buffer reference with it) and remember the id's final state.

        Returns the slot as it was (its state before finishing), or None if it was not live.
        """
        slot = self._slots.pop(request_id, None)
        if slot is None:
            return None
        self._finished[request_id] = state
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)
        return slot

    def _on_future_done(self, request_id: str, future: asyncio.Future[KVHeader]) -> None:
        # Someone cancelled the future itself (wait_for timing out): same as `cancel`.
        slot = self._slots.get(request_id)
        if future.cancelled() and slot is not None and slot.future is future:
            self.cancel(request_id)


def _mark_retrieved(future: asyncio.Future[KVHeader]) -> None:
    if not future.cancelled():
        future.exception()


class FailMode(enum.Enum):
    """How an injected failure breaks one send (see `LoopbackHub.fail_next`)."""

    UNREACHABLE = "unreachable"  # nothing reaches the receiver; the sender raises TransferError
    PEER_LOST = "peer_lost"  # half the payload lands, then the link breaks: both sides fail
    ACK_LOST = "ack_lost"  # the payload lands (receiver DONE) but the sender raises TransferError
    CORRUPT_HEADER = "corrupt_header"  # the header is garbled on the way: refused as MALFORMED


class LoopbackHub:
    """The stand-in network: a name -> receiver registry plus failure injection and latency."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s  # each send waits this long before delivering (tests timeouts)
        self.frames = 0  # frames that reached a receiver, refused or not
        self._receivers: dict[str, LoopbackReceiver] = {}
        self._failures: deque[tuple[FailMode, str | None]] = deque()

    def fail_next(self, count: int = 1, mode: FailMode = FailMode.UNREACHABLE, address: str | None = None) -> None:
        """Make the next `count` sends (to `address`, or to any) fail with `mode`."""
        self._failures.extend([(mode, address)] * count)

    def take_failure(self, address: str) -> FailMode | None:
        """Consume the first queued failure that applies to `address` (called by a send)."""
        for index, (mode, target) in enumerate(self._failures):
            if target is None or target == address:
                del self._failures[index]
                return mode
        return None

    def register(self, receiver: LoopbackReceiver) -> None:
        if receiver.address in self._receivers:
            raise ValueError(f"{receiver.address} is already registered")
        self._receivers[receiver.address] = receiver

    def unregister(self, receiver: LoopbackReceiver) -> None:
        if self._receivers.get(receiver.address) is receiver:
            del self._receivers[receiver.address]

    def lookup(self, address: str) -> LoopbackReceiver:
        receiver = self._receivers.get(address)
        if receiver is None:
            raise TransferError(f"no receiver at {address}")
        return receiver


class LoopbackReceiver:
    """`KVReceiver` in process: frames arrive through `deliver`, called by `LoopbackSender`."""

    carries_device_memory = False

    def __init__(self, hub: LoopbackHub, name: str) -> None:
        self.address = LOOPBACK_SCHEME + name
        self._hub = hub
        self._table = ReceiveTable()
        self._started = False

    async def start(self) -> None:
        """Register with the hub: from now on senders can reach this receiver."""
        if not self._started:
            self._hub.register(self)
            self._started = True

    async def landing_memory(self, token: str, nbytes: int) -> memoryview | None:
        return None  # in process: the sender copies into whatever buffer `expect` is given

    def landing_name(self, token: str) -> str:
        return ""  # no shared memory

    async def prefault_landing_up_to(self, largest: int) -> int:
        return 0  # no shared memory to make

    def expect(self, request_id: str, buffer: KVBytes, token: str = "") -> asyncio.Future[KVHeader]:
        """See `KVReceiver.expect`; call from the event loop the transfers run in."""
        return self._table.expect(request_id, host_only(buffer), token)

    def state(self, request_id: str) -> TransferState | None:
        return self._table.state(request_id)

    def cancel(self, request_id: str) -> None:
        """The future raises CancelledError; a copy in progress stops at its next chunk."""
        self._table.cancel(request_id)

    async def close(self) -> None:
        """Unregister (later sends raise TransferError) and fail every pending transfer."""
        self._hub.unregister(self)
        self._table.close(TransferError(f"receiver {self.address} closed"))

    async def deliver(self, header_bytes: bytes, payload: memoryview, mode: FailMode | None) -> Refusal:
        """Receive one frame (called by a sender): validate, copy, and return the ack code."""
        self._hub.frames += 1
        if mode is FailMode.CORRUPT_HEADER:
            header_bytes = bytes(byte ^ 0x5A for byte in header_bytes)
        try:
            header = KVHeader.from_bytes(header_bytes)
            buffer = host_only(self._table.admit(header))
        except FrameRefused as refused:
            log.warning("%s refused a frame: %s", self.address, refused)
            return refused.code
        except TransferError as error:
            log.warning("%s refused a frame: %s", self.address, error)
            return Refusal.MALFORMED
        return await self._land(header, buffer, payload, mode)

    async def _land(self, header: KVHeader, buffer: memoryview, payload: memoryview,
                    mode: FailMode | None) -> Refusal:
        """Copy the payload into the admitted buffer in chunks; stops if cancelled meanwhile."""
        if payload.nbytes != header.nbytes:
            reason = f"payload of {payload.nbytes} bytes, header says {header.nbytes}"
            log.warning("%s refused a frame: %s", self.address, reason)
            self._table.fail(header.request_id, FrameRefused(Refusal.WRONG_SIZE, reason))
            return Refusal.WRONG_SIZE
        end = payload.nbytes // 2 if mode is FailMode.PEER_LOST else payload.nbytes
        for start in range(0, end, COPY_CHUNK_BYTES):
            stop = min(start + COPY_CHUNK_BYTES, end)
            buffer[start:stop] = payload[start:stop]
            await asyncio.sleep(0)
            if not self._table.is_live(header.request_id, buffer):
                return Refusal.CANCELLED  # cancelled or closed mid-copy: no more bytes land
        if mode is FailMode.PEER_LOST:
            self._table.fail(header.request_id, TransferError(f"peer lost during {header.request_id!r}"))
            return Refusal.FAILED
        self._table.complete(header)
        return Refusal.OK


class LoopbackSender:
    """`KVSender` in process; `timeout_s` bounds each send as the network senders do."""

    carries_device_memory = False

    def __init__(self, hub: LoopbackHub, timeout_s: float = 30.0) -> None:
        self._hub = hub
        self._timeout_s = timeout_s
        self._closed = False

    def transport_to(self, address: str, landing: str = "") -> str:
        return "loopback"

    async def start(self) -> None:
        """Nothing to ready in process."""

    async def send(self, address: str, header: KVHeader, payload: KVBytes, landing: str = "") -> None:
        """Deliver one frame; returns once the payload is in the receiver's buffer.

        Raises TransferError if the receiver is missing, refused the frame, or an injected failure
        hit it; raises ValueError for a payload whose size differs from `header.nbytes`.
        """
        await self.send_raw(address, header.to_bytes(), host_only(checked_payload(header, payload)))

    async def send_raw(self, address: str, header_bytes: bytes, payload: memoryview,
                       declared_length: int | None = None) -> None:
        """Send a frame whose header bytes are given as is (tests: malformed or lying frames).

        `declared_length` stands for the wire's length prefix; one that differs from the header's
        length makes the frame MALFORMED, as on UCX.
        """
        if self._closed:
            raise TransferError("the sender is closed")
        try:
            code = await asyncio.wait_for(self._deliver(address, header_bytes, payload, declared_length),
                                          self._timeout_s)
        except TimeoutError as error:
            raise TransferError(f"send to {address} timed out after {self._timeout_s} s") from error
        if code is not Refusal.OK:
            raise FrameRefused(code, f"by {address}")

    async def _deliver(self, address: str, header_bytes: bytes, payload: memoryview,
                       declared_length: int | None) -> Refusal:
        mode = self._hub.take_failure(address)
        if self._hub.latency_s:
            await asyncio.sleep(self._hub.latency_s)
        if mode is FailMode.UNREACHABLE:
            raise TransferError(f"injected failure: {address} unreachable")
        receiver = self._hub.lookup(address)
        if declared_length is not None and declared_length != len(header_bytes):
            header_bytes = b""  # a lying length prefix desynchronises the frame: unreadable
        code = await receiver.deliver(header_bytes, host_only(readable_bytes(payload)), mode)
        if mode is FailMode.PEER_LOST:
            raise TransferError(f"injected failure: link to {address} lost mid-payload")
        if mode is FailMode.ACK_LOST:
            raise TransferError(f"injected failure: ack from {address} lost (the payload landed)")
        return code

    async def close(self) -> None:
        """Later sends raise TransferError (nothing else to release in process)."""
        self._closed = True
