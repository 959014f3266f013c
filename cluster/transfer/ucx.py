"""The UCX KV connector (ucxx): `UCXReceiver` listens on host:port, `UCXSender` connects to it.

Wire format, one transfer on one endpoint (UCX tag messages on the endpoint's own tags, in order):

    sender -> receiver   8 + N bytes the header's length N (unsigned little-endian), then the header,
                                     `KVHeader.to_bytes()` (msgpack), N <= MAX_HEADER_BYTES: one message
                                     (each message costs the sender a post and the receiver a wake-up)
    sender -> receiver   M bytes     the payload; the receiver probes its size, checks it against the
                                     header and the buffer given to `expect`, then receives it straight
                                     into that buffer (no intermediate copy)
    receiver -> sender   1 byte      the ack: 0 = landed, else a `Refusal` code (the sender raises)

Same host (`shm.py`): when the receiver's address names this host's identity and the receiver gave
the transfer a shared-memory landing segment, the header says `in_place`, the sender then copies
the payload into the segment and sends a 1-byte marker (`WRITTEN`) where the payload would be; the
receiver checks the marker and acks as above. Everything else (deadlines, refusals, aborts, a
dead peer) is the same exchange on the same endpoint. `send` returns the transport used.

A refused frame (id not expected, size differs, header too long or malformed, a length prefix that
is not the header's, id already finished, cancelled, busy) is logged, its payload drained into a
1-byte scratch buffer (UCX discards the rest as a truncated message) and acked with the refusal
code: it never touches a registered buffer, and the endpoint stays usable. A frame that breaks the
message sequence (a missing message) ends in a timeout or a UCX error and aborts the endpoint instead.
An endpoint carries one transfer at a time: the sender keeps a small pool of endpoints per address
(`max_endpoints_per_peer`) for concurrency.

Who may hold the listener (a peer that reaches the port needs no ticket to connect): a receiver
serves at most `MAX_ENDPOINTS` endpoints at once (more are aborted as they connect); a new endpoint
must bring a valid first frame within `HANDSHAKE_TIMEOUT_S`, and one idle between frames for
`IDLE_TIMEOUT_S` is closed (senders retire pooled endpoints at half of that). Idle waits wake on the
receiver's progress tick alone, so idle endpoints cost no timers or progress calls of their own.

Every connect, send and receive has a deadline (`asyncio.timeout`, the in-task form of
`asyncio.wait_for`); on a timeout or a UCX error the endpoint is aborted, which also stops any bytes
still in flight into a registered buffer. A killed peer raises `UCXXConnectionResetError` within
tens of milliseconds over TCP: TransferError here.

Progress. ucxx 0.52 is used in "blocking" progress mode, with two repairs (`_Progress`, `_Link`):
its blocking mode never re-arms the worker, so after the first UCX event the event loop spins
forever (most of a core), and its `Endpoint.send/recv` await a request with a `sleep(0)` loop, which
spins while the peer works (on few loaded cores that steals the peer's CPU: an ack then waits a
scheduler slice). Requests are awaited on UCX progress events instead, and an idle receiver uses
next to no CPU. Both use ucxx internals (checked against ucxx 0.52): `_Progress`
falls back to polling if they change, `_Link` fails loudly. A connect is tried in several short
attempts (`UCXSender._connect`): one to a just-closed port sometimes hangs in ucxx's handshake.

Transports. UCX reads its settings from the environment when `ucxx.init` runs (once per process,
`init_ucx`); set them before the first receiver or sender starts, or pass `transports=`:
- default (UCX_TLS unset, or `UCX_TLS=tcp`): listener endpoints have error handling on, which on a
  host without RDMA means TCP, loopback included (`benchmarks/kv_transfer.py` measures it).
- `UCX_TLS=sm,self` (shared memory, several times faster than TCP) is used by UCX only
  for endpoints created from a worker address with error handling off; a dead peer then hangs
  instead of failing. This connector does not do that: listener endpoints always have error
  handling on, so sm is never chosen for them, and UCX_TLS=sm,self alone makes the connect fail
  ("Destination is unreachable"). The benchmark measures sm with worker-address endpoints.
- RDMA (`UCX_TLS=rc,...`) needs an RDMA NIC; the tests do not cover it.
- GPU memory: a payload or receive buffer in device memory (`DeviceBytes`) is moved by UCX's
  `cuda_copy` transport (pipelined through UCX's own pinned buffers over TCP), `cuda_ipc` between
  processes on one node, GPUDirect RDMA with `rc` + `gdr_copy`. UCX_TLS must allow `cuda_copy`
  (`ucx_carries_device_memory`); otherwise the worker stages through pinned host memory itself.
  Written against ucxx's documented `__cuda_array_interface__` support, not yet run on a GPU.
UCX_WARN_UNUSED_ENV_VARS=n is set by default (each process would print a warning otherwise). The
thread progress mode is slower on few cores; polling collapses under load. UCX_TCP_MAX_POLL=1 (UCX
reads a socket less greedily per progress call) makes no difference beyond the benchmark's
run-to-run noise. UCXX_LOG_LEVEL=FATAL silences UCXX's own "endpoint error"
lines, printed when a peer is unreachable or dies.
The listener binds every interface (ucxx takes no bind address): `host` is the address advertised.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from cluster.transfer import shm
from cluster.transfer.connector import MAX_HEADER_BYTES, KVBytes, KVHeader, TransferError, TransferState
from cluster.transfer.loopback import (
    FrameRefused,
    ReceiveTable,
    Refusal,
    checked_payload,
    host_only,
    is_device_bytes,
    readable_bytes,
)
from cluster.transfer.phases import PhaseLog

log = logging.getLogger(__name__)

UCX_SCHEME = "ucx://"
PREFIX = struct.Struct("<Q")
WRITTEN = b"\x01"  # the marker an in-place (shared-memory) frame sends in place of its payload
# A payload's deadline grows with its size: `timeout_s` plus this rate's worth (slow but alive).
MIN_BYTES_PER_S = 50e6
# Waits wake on UCX progress; a watchdog progresses and re-arms this often anyway (a safety net).
WAKE_UP_S = 0.05
# How long an abort may drive progress for its endpoint's in-flight request to finish, and how many
# progress calls it makes at least (a process descheduled past the deadline still makes them).
SETTLE_S = 1.0
SETTLE_CALLS = 8
# A receiver's bounds on who holds its listener (`UCXReceiver`): endpoints served at once (more are
# aborted as they connect, with a warning); how long a new endpoint may take to bring its first valid
# frame (one not refused as malformed or unauthenticated); how long one may then sit idle between
# frames. Senders retire their pooled endpoints before that (`UCXSender`, half of it), so that a
# transfer never starts on an endpoint the receiver is closing.
MAX_ENDPOINTS = 256
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 300.0
T = TypeVar("T")

_ucxx: Any = None  # the ucxx module once `init_ucx` ran (imported late: the environment goes first)
# Requests that were still in flight when their endpoint was aborted and the flush gave up, with the
# memory they read or write: kept alive until UCX completes them, never freed under UCX's feet (a
# late write into freed memory corrupts whatever lives there next). Pruned at every settle.
_UNSETTLED: list[tuple[Any, Any]] = []


def transports_in_use() -> str:
    """The transports UCX was told to use (UCX_TLS), as a log line says it. UCX picks the lanes of
    each endpoint among them; `UCX_PROTO_INFO=y` makes it print its choice per endpoint."""
    configured = os.environ.get("UCX_TLS", "")
    if configured:
        return f"UCX_TLS={configured}"
    return "UCX's default (listener endpoints: TCP, or RDMA where a NIC has it)"


def ucx_carries_device_memory(transports: str | None = None) -> bool:
    """Whether UCX, told to use `transports` (else UCX_TLS), may be handed GPU buffers: it needs its
    CUDA copy transport, which UCX's default (UCX_TLS unset or `all`), `cuda` and `cuda_copy`
    include, as does an exclusion list (`^...`) that does not name it. The wheels (libucx-cu12) are
    built with CUDA; the GPU driver must be there at run time."""
    names = [name.strip() for name in (transports or os.environ.get("UCX_TLS", "")).split(",") if name.strip()]
    if not names:
        return True
    if names[0].startswith("^"):
        return not {names[0][1:], *names[1:]} & {"cuda", "cuda_copy"}
    return bool({"all", "cuda", "cuda_copy"} & set(names))


def init_ucx(transports: str | None = None) -> Any:
    """Initialise UCX once per process (called by `start` and by the first send); returns `ucxx`.

    `transports` sets UCX_TLS if UCX is not initialised yet (ignored afterwards: UCX reads its
    settings once). Sets UCX_WARN_UNUSED_ENV_VARS=n unless the environment says otherwise.
    """
    global _ucxx
    if _ucxx is not None:
        return _ucxx
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if transports is not None:
        os.environ["UCX_TLS"] = transports
    import ucxx

    try:
        ucxx.init(progress_mode="blocking")
    except RuntimeError:
        log.info("ucxx was already initialised by someone else; keeping its settings")
    fix_handshake()
    _ucxx = ucxx
    log.info("UCX initialised: transports %s", transports_in_use())
    return ucxx


# Buffers of endpoint handshakes that ended early, which UCX may still write into: never freed.
_ABANDONED_HANDSHAKES: list[Any] = []


def fix_handshake() -> None:
    """Replace ucxx's endpoint handshake (`exchange_peer_info`, ucxx 0.52) with one that keeps its
    buffers alive when it ends early.

    Connecting and accepting, ucxx posts a stream receive of the peer's 16-byte info into a bytearray
    and waits for it with a timeout. When the wait ends early (its timeout, or a caller cancelling the
    connect: `UCXSender._connect` does after each attempt), the bytearray is freed while the receive
    is still posted; on a loaded machine the peer's reply then arrives and UCX writes it into freed
    memory. Python's allocator is corrupted and the process dies later of SIGSEGV in
    `_PyObject_Malloc` (in a prefill worker under load, at the first `_Progress` after a connect).
    Same wire exchange (the info, then a checksum check), in the same order; fails loudly if ucxx moves it.
    """
    from ucxx._lib.arr import Array
    from ucxx._lib_async import application_context
    from ucxx._lib_async import listener as listener_module
    from ucxx._lib_async.utils import hash64bits

    async def exchange_peer_info(endpoint: Any, msg_tag: int, listener: bool,
                                 connect_timeout: float = 5.0) -> dict[str, int]:
        mine = struct.pack("QQ", msg_tag, hash64bits(msg_tag))
        theirs = bytearray(len(mine))
        buffers = (Array(mine), Array(theirs))
        steps = [(endpoint.stream_send, buffers[0]), (endpoint.stream_recv, buffers[1])]
        try:
            for post, buffer in steps if listener else steps[::-1]:  # the listener speaks first
                await asyncio.wait_for(post(buffer).wait(), timeout=connect_timeout)
        except BaseException:
            _ABANDONED_HANDSHAKES.append(buffers)  # a request may still be posted on them
            raise
        tag, checksum = struct.unpack("QQ", theirs)
        if checksum != hash64bits(tag):
            raise RuntimeError(f"checksum invalid: {hex(hash64bits(tag))} != {hex(checksum)}")
        return {"msg_tag": tag, "checksum": checksum}

    for module in (application_context, listener_module):
        if not callable(getattr(module, "exchange_peer_info", None)):
            raise RuntimeError(f"ucxx changed: {module.__name__} has no exchange_peer_info to fix")
        module.exchange_peer_info = exchange_peer_info  # type: ignore[attr-defined]


def reset_ucx() -> None:
    """Shut UCX down in this process (tests, process exit): close every receiver and sender first.

    Raises if endpoints or listeners are still referenced (ucxx.reset's rule). The next
    `init_ucx` starts afresh, reading the environment again.
    """
    global _ucxx
    if _ucxx is None:
        return
    _Progress.close_all()
    gc.collect()  # closed endpoints still in reference cycles would make reset refuse
    _ucxx.reset()
    _ucxx = None


def fix_progress() -> None:
    """Install the fixed blocking-mode progress (see `_Progress`) on the running loop, for code that
    uses ucxx directly (receivers, senders and `complete` install it themselves)."""
    _Progress.of(asyncio.get_running_loop())


class _Progress:
    """UCX progress for one event loop: ucxx's blocking mode, fixed, plus wake-ups for waiters.

    ucxx 0.52's blocking mode progresses the worker when its epoll descriptor is readable but never
    arms the worker again after the first event, so the descriptor stays readable and the event
    loop spins (most of a core, idle or not, for the life of the process). This replaces its reader
    with one that re-arms (progress, let ready tasks run, `worker.arm()` until it holds: the ucx-py
    recipe) and resolves a future on each progress: `wait` returns then, so `_Link` and `complete`
    check their requests exactly when UCX did something. Relies on ucxx internals (`ProgressTasks`);
    if they change, it logs and does nothing (waits then poll every `WAKE_UP_S`: correct, slower).
    """

    _by_loop: dict[asyncio.AbstractEventLoop, _Progress] = {}

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Progress:
        """The driver of `loop`, installed on first use (ucxx's own progress first, if not yet)."""
        progress = cls._by_loop.get(loop)
        if progress is None:
            init_ucx().continuous_ucx_progress(loop)  # creates ucxx's BlockingMode for this loop
            progress = cls._by_loop[loop] = cls(loop)
        return progress

    @classmethod
    def close_all(cls) -> None:
        """Uninstall every driver (called by `reset_ucx`: the worker is going away)."""
        for progress in cls._by_loop.values():
            progress.close()
        cls._by_loop.clear()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._changed: asyncio.Future[None] = loop.create_future()
        self._armer: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._worker: Any = None
        self._fd = -1
        try:
            from ucxx._lib_async.application_context import ProgressTasks

            worker = ProgressTasks[loop].worker
            fd = worker.epoll_file_descriptor
        except (ImportError, KeyError, AttributeError) as error:
            log.warning("cannot fix ucxx's blocking progress (%r): the event loop may spin", error)
            return
        self._worker, self._fd = worker, fd
        loop.remove_reader(fd)
        loop.add_reader(fd, self._on_event)
        self._watchdog = loop.create_task(self._watch())

    def close(self) -> None:
        if self._fd >= 0 and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        for task in (self._armer, self._watchdog):
            if task is not None:
                task.cancel()
        self._worker, self._fd = None, -1

    async def wait(self, poll: bool = True) -> None:
        """Return after the next UCX progress, or after WAKE_UP_S (then, with `poll`, progress here,
        re-armed; without, the watchdog's progress every WAKE_UP_S is the waiter's too: one progress
        for all waiters instead of one each)."""
        if self._changed.done():
            self._changed = self._loop.create_future()
        if not poll and self._watchdog is not None:  # no timer of its own: the watchdog's tick wakes it
            await asyncio.shield(self._changed)
            return
        try:
            async with asyncio.timeout(WAKE_UP_S):
                await asyncio.shield(self._changed)
        except TimeoutError:
            if poll and self._worker is not None:
                self._on_event()

    def _on_event(self) -> None:
        """The worker's descriptor is readable (or a wait timed out): progress, then re-arm."""
        self._progress()
        if self._armer is None or self._armer.done():
            self._armer = self._loop.create_task(self._arm())

    def progress_now(self) -> None:
        """Progress the worker once, here and now (and wake the waiters), then re-arm it as after an
        event: what the progress started (a message going out, a reply to come) then wakes the loop."""
        if self._worker is not None and not self._loop.is_closed():
            self._on_event()

    def _progress(self) -> None:
        self._worker.progress()
        if not self._changed.done():
            self._changed.set_result(None)

    async def _watch(self) -> None:
        # An event can be consumed by a progress that is not ours (ucxx's 1 s tick) and leave the
        # worker unarmed: then nothing wakes the loop, and ucxx's own waits (a connect's handshake)
        # stall for seconds. Progress and re-arm every WAKE_UP_S, whatever happens (~20 wake-ups/s).
        while self._worker is not None:
            await asyncio.sleep(WAKE_UP_S)
            if self._worker is not None:
                self._on_event()

    async def _arm(self) -> None:
        # Arm only once the tasks made ready by this progress ran (they may post UCX operations):
        # UCX arms a worker only when nothing is pending, else returns False and wants progress.
        while self._worker is not None:
            await asyncio.sleep(0)
            if self._worker.arm():
                return
            self._progress()


def parse_address(address: str) -> tuple[str, int]:
    """'ucx://host:port' (with an optional '?host=...&rid=...', `shm.SameHost`) -> (host, port);
    raises TransferError on anything else."""
    if not address.startswith(UCX_SCHEME):
        raise TransferError(f"not a UCX address: {address!r}")
    host, _, port = address[len(UCX_SCHEME):].partition("?")[0].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"malformed UCX address: {address!r}")
    return host.strip("[]"), int(port)


def _is_transport_error(error: BaseException) -> bool:
    """UCX's own errors (reset, not connected, cancelled, truncated...) and timeouts."""
    if isinstance(error, TimeoutError):
        return True
    return _ucxx is not None and isinstance(error, _ucxx.exceptions.UCXError)


def _refusal(code: int) -> Refusal:
    try:
        return Refusal(code)
    except ValueError:
        return Refusal.FAILED  # a code this version does not know: still a refusal


def _payload_timeout(timeout_s: float, nbytes: int) -> float:
    return timeout_s + nbytes / MIN_BYTES_PER_S


async def _bounded(awaitable: Awaitable[T], timeout_s: float) -> T:
    """Await with a deadline (TimeoutError), in the calling task (`asyncio.wait_for` would start a
    task: a step later, and a `cancel` could slip in between)."""
    async with asyncio.timeout(timeout_s):
        return await awaitable


def _abort(endpoint: Any) -> None:
    """Close an endpoint at once: cancels its in-flight requests, so no more bytes land anywhere."""
    try:
        endpoint.abort()
    except Exception as error:  # aborting a broken endpoint may raise; it is gone either way
        log.debug("abort of an endpoint failed: %s", error)


class _Link:
    """One ucxx endpoint whose operations are awaited without spinning the event loop.

    ucxx's `Endpoint.send/recv` await their request with a `sleep(0)` loop: the loop spins for as
    long as the peer takes, which on few cores steals the very CPU the peer needs (an ack then waits
    a scheduler slice). Here a request is posted through the same (internal) calls and its
    completion checked after each UCX progress (`_Progress.wait`).
    """

    def __init__(self, endpoint: Any) -> None:
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        self.endpoint = endpoint
        self._array, self._mask = Array, TagMaskFull
        self._send_tag, self._recv_tag = Tag(endpoint._tags["msg_send"]), Tag(endpoint._tags["msg_recv"])
        self._progress = _Progress.of(asyncio.get_running_loop())
        # Requests posted and not yet seen complete, with the memory they use (kept alive until then).
        self._pending: list[tuple[Any, Any]] = []
        self.waits = 0  # requests this link had to wait for (not complete when awaited): its round trips
        self.idle_since = 0.0  # when a sender last put it back in its pool (`UCXSender`)

    @property
    def closed(self) -> bool:
        return bool(self.endpoint.closed)

    def abort(self) -> None:
        """Close the endpoint now; returns once its in-flight request is over (see `_settle`)."""
        _abort(self.endpoint)
        self._settle()

    def _settle(self) -> None:
        # After the abort UCX still delivers what it had already read from the socket (tens of KiB)
        # at the next progress: drive progress here until the request is done, so that no byte lands
        # in a registered buffer once `cancel` returned. Bounded: UCX fails the request at once, so
        # this normally takes one or two calls; the bound is counted in calls as well as in time
        # because on a loaded machine the process may sleep past a deadline before its first call.
        deadline, calls = time.monotonic() + SETTLE_S, 0
        while self._unfinished() and (calls < SETTLE_CALLS or time.monotonic() < deadline):
            self._progress.progress_now()
            calls += 1
        _UNSETTLED[:] = [(late, kept) for late, kept in _UNSETTLED if not late.completed]
        if self._unfinished():
            _UNSETTLED.extend(self._pending)
            self._pending = []
            log.warning("a UCX request was still in flight %.0f ms after its endpoint closed: its memory is kept "
                        "until it completes", 1e3 * SETTLE_S)

    def _unfinished(self) -> bool:
        self._pending = [(request, memory) for request, memory in self._pending if not request.completed]
        return bool(self._pending)

    async def send(self, buffer: Any, timeout_s: float) -> None:
        await self.wait(self.post_send(buffer), timeout_s)

    async def recv(self, buffer: Any, timeout_s: float) -> None:
        await self.wait(self.post_recv(buffer), timeout_s)

    def post_send(self, buffer: Any) -> Any:
        """Start sending `buffer` (kept alive until the send completes) and return its request, to
        `wait` for. The message leaves at the progress made here (UCX writes to its socket only when
        progressed); a reply the peer sent after reading it means it is out, so a sender may wait
        for the reply alone."""
        raw, array = self._live(), self._array(buffer)
        request = self._posted(raw.tag_send(array, self._send_tag), array)
        self._progress.progress_now()  # UCX writes a posted message to its socket at a progress: now
        return request

    def post_recv(self, buffer: Any) -> Any:
        """Start receiving the next message into `buffer` (posted early, a reply completes at the
        very progress that brings it)."""
        raw, array = self._live(), self._array(buffer)
        return self._posted(raw.tag_recv(array, self._recv_tag, self._mask), array)

    async def recv_probed(self, buffer: Any, probe: Any, timeout_s: float) -> None:
        """Receive the message `probe` took off the queue (`next_message(remove=True)`)."""
        self._live()
        worker, array = self.endpoint._ctx.worker, self._array(buffer)
        await self.wait(self._posted(worker.tag_recv_with_handle(array, probe), array), timeout_s)

    def _posted(self, request: Any, memory: Any) -> Any:
        self._pending.append((request, memory))  # an abort settles it (`_settle`) if it is still in flight
        return request

    async def wait(self, request: Any, timeout_s: float) -> None:
        """Until the posted `request` completes (then raises its error, if any): TimeoutError after
        `timeout_s`. If the wait fails, the request stays pending: the abort that follows settles it."""
        if not request.completed:
            self.waits += 1
        await complete(request, timeout_s)
        self._unfinished()  # forget what completed

    async def next_message(self, remove: bool, timeout_s: float | None, idle: bool = False) -> Any:
        """Wait until a message waits; returns UCX's probe result (its size), the message taken off
        UCX's queue if `remove` (then receive it with `recv_probed`). TimeoutError after `timeout_s`,
        UCXCloseError once the endpoint is closed (aborted by `cancel`/`close`, or the peer left).
        `idle`: a wait between frames, which may be long and one of many: it wakes on UCX progress
        only (`_Progress.wait(poll=False)`), so idle endpoints add no timers or progress calls."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            self._live()
            probe = self.endpoint.tag_probe(remove=remove)
            if probe.matched:
                return probe
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError("no message before the deadline")
            await self._progress.wait(poll=not idle)

    def _live(self) -> Any:
        """The raw endpoint; raises the peer's error, or UCXCloseError once aborted."""
        raw = self.endpoint._ep
        if raw is None:
            raise init_ucx().exceptions.UCXCloseError("endpoint closed")
        raw.raise_on_error()
        return raw


async def complete(request: Any, timeout_s: float) -> None:
    """Await a raw ucxx request without spinning the loop (see `_Link`): until it completes (then
    raises its error, if any) or `timeout_s` passes (TimeoutError). For code using ucxx directly."""
    progress = _Progress.of(asyncio.get_running_loop())
    async with asyncio.timeout(timeout_s):
        while not request.completed:
            await progress.wait()
    request.check_error()


class UCXReceiver:
    """`KVReceiver` over a ucxx listener; one serving task per connected sender endpoint. Buffers may
    be host bytes or, where `carries_device_memory`, GPU bytes (UCX writes them with CUDA copies)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,  # noqa: PLR0913
                 transports: str | None = None, shared_memory: bool = True, segment_dir: str = shm.SHM_DIR, *,
                 max_endpoints: int = MAX_ENDPOINTS, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.address = ""  # "ucx://host:port" once started (plus "?host=...&rid=..." with shared memory)
        self._host = host
        self._port = port
        self._timeout_s = timeout_s
        self._max_endpoints = max_endpoints
        self._handshake_timeout_s, self._idle_timeout_s = handshake_timeout_s, idle_timeout_s
        self._refused_endpoints = 0  # aborted past `max_endpoints` (logged every power of two)
        self._transports = transports
        self._table = ReceiveTable(on_stop=self._stop_receiving)
        self._listener: Any = None
        self._links: set[_Link] = set()
        self._receiving: dict[str, _Link] = {}  # request id -> link whose payload fills its buffer
        # Same-host senders write payloads into shared-memory segments (`landing_memory`), if on.
        self._segments = shm.Segments(segment_dir) if shared_memory else None
        self._in_place: dict[str, str] = {}  # request id -> token of the segment its buffer is
        self.phases = PhaseLog()  # timestamps of each frame's steps, when on (benchmarks/kv_transfer.py)
        self._closed = False

    @property
    def carries_device_memory(self) -> bool:
        return ucx_carries_device_memory(self._transports)

    async def start(self) -> None:
        """Listen (port 0 picks a free one) and set `address`; call once, in the serving event loop."""
        if self._listener is not None:
            return
        ucxx = init_ucx(self._transports)
        self._listener = ucxx.create_listener(self._serve, self._port)
        _Progress.of(asyncio.get_running_loop())
        self.address = f"{UCX_SCHEME}{self._host}:{self._listener.port}"
        if self._segments is not None:
            self.address += shm.SameHost(shm.host_identity(), self._segments.receiver_id).suffix()
            if removed := self._segments.remove_orphans():
                log.info("removed %d shared-memory KV segments left by dead receivers", removed)
        log.info("UCX receiver listening at %s", self.address)

    async def landing_memory(self, token: str, nbytes: int) -> memoryview | None:
        """See `KVReceiver.landing_memory`: a shared-memory segment, unless shared memory is off (a
        new one is faulted in on a thread, a pooled one comes at once)."""
        if self._segments is None or self._closed:
            return None
        return await self._segments.allocate(token, nbytes)

    async def prefault_landing(self, nbytes: int, count: int = 1) -> int:
        """Make `count` shared-memory segments for transfers of `nbytes` now, off the loop, and pool
        them (`shm.Segments.prefault`); how many were. Nothing without shared memory."""
        if self._segments is None or self._closed:
            return 0
        return await self._segments.prefault(nbytes, count)

    async def prefault_landing_up_to(self, largest: int) -> int:
        """See `KVReceiver.prefault_landing_up_to`: one pooled segment per size class up to `largest`
        (`shm.Segments.prefault_up_to`); how many were made. Nothing without shared memory."""
        if self._segments is None or self._closed:
            return 0
        return await self._segments.prefault_up_to(largest)

    def landing_name(self, token: str) -> str:
        """See `KVReceiver.landing_name`: the random name of the segment `landing_memory` gave."""
        return self._segments.landing_name(token) if self._segments is not None else ""

    def expect(self, request_id: str, buffer: KVBytes, token: str = "") -> asyncio.Future[KVHeader]:
        """See `KVReceiver.expect`; call from the event loop the receiver started in. A `buffer` that
        is the segment `landing_memory(token, ...)` gave can take in-place frames; the segment's
        name is unlinked when the transfer ends, however it ends."""
        try:
            future = self._table.expect(request_id, buffer, token)
        except BaseException:
            if self._segments is not None:
                self._segments.release(token)  # nothing will land in it
            raise
        if self._segments is not None and self._segments.holds(token):
            if self._segments.covers(token, buffer):
                self._in_place[request_id] = token
            future.add_done_callback(lambda done: self._end_segment(request_id, token, done))
        return future

    def _end_segment(self, request_id: str, token: str, done: asyncio.Future[KVHeader]) -> None:
        if self._in_place.get(request_id) == token:
            del self._in_place[request_id]
        if self._segments is not None:  # reused only after a transfer that ended well: no sender writes any more
            self._segments.release(token, reusable=not done.cancelled() and done.exception() is None)

    def state(self, request_id: str) -> TransferState | None:
        return self._table.state(request_id)

    def cancel(self, request_id: str) -> None:
        """The future raises CancelledError; a payload being received has its endpoint aborted
        (its sender raises TransferError), so none of its bytes land after this returns."""
        self._table.cancel(request_id)

    def _stop_receiving(self, request_id: str) -> None:
        """A cancel hit a payload in flight (called by the table): abort the endpoint carrying it."""
        link = self._receiving.pop(request_id, None)
        if link is not None:
            link.abort()

    async def close(self) -> None:
        """Abort every endpoint, fail pending transfers with TransferError, stop listening.

        Later frames are refused (new endpoints are aborted at once) until the listener is gone.
        """
        self._closed = True
        for link in list(self._links):
            link.abort()
        self._links.clear()
        self._receiving.clear()
        self._table.close(TransferError(f"receiver {self.address} closed"))
        if self._segments is not None:
            self._segments.close()
        if self._listener is not None:
            await self._wait_for_handlers()
            self._listener.close()
            self._listener = None

    async def _wait_for_handlers(self) -> None:
        """Let the serving tasks (their endpoints aborted) return before the listener goes: ucxx
        warns about a listener dropped with live handlers. Bounded: a stuck handler is left behind."""
        wait = getattr(self._listener, "_wait_for_active_clients", None)  # ucxx internals, may change
        try:
            await asyncio.wait_for(wait() if wait is not None else asyncio.sleep(0), self._timeout_s)
        except TimeoutError:
            log.warning("%s: serving tasks still running at close", self.address)

    async def _serve(self, endpoint: Any) -> None:
        """Listener callback, one task per sender endpoint: handle its frames until it goes away, or
        until it brings no valid frame within the handshake timeout, or sits idle past the idle one."""
        link = _Link(endpoint)
        if self._closed or not self._admit(link):
            link.abort()
            return
        loop = asyncio.get_running_loop()
        handshake_until: float | None = loop.time() + self._handshake_timeout_s  # until its first valid frame
        try:
            while not self._closed and not link.closed:
                wait_s = self._idle_timeout_s if handshake_until is None else max(0.0, handshake_until - loop.time())
                opening = await self._next_opening(link, wait_s, handshake_until is not None)
                if await self._handle_frame(link, await self._recv_opening(link, opening)):
                    handshake_until = None
        except Exception as error:
            # Peers leaving, timeouts and our own aborts (cancel, close) end up here alike.
            expected = _is_transport_error(error) or self._closed or link.closed
            log.log(logging.DEBUG if expected else logging.WARNING, "%s: endpoint ended: %r", self.address, error)
        finally:
            self._links.discard(link)
            link.abort()

    def _admit(self, link: _Link) -> bool:
        """Serve one more endpoint, unless `max_endpoints` are served already (then say so, sparingly)."""
        if len(self._links) < self._max_endpoints:
            self._links.add(link)
            return True
        self._refused_endpoints += 1
        if self._refused_endpoints & (self._refused_endpoints - 1) == 0:  # 1, 2, 4, 8...: a flood logs little
            log.warning("%s refused an endpoint: %d served already (the bound); %d refused so far", self.address,
                        len(self._links), self._refused_endpoints)
        return False

    async def _next_opening(self, link: _Link, wait_s: float, handshake: bool) -> Any:
        """The next frame's first message, within `wait_s`; TimeoutError (logged) if none comes."""
        try:
            return await link.next_message(remove=True, timeout_s=wait_s, idle=True)
        except TimeoutError:
            log.info("%s closed an endpoint %s", self.address,
                     f"that sent no valid frame within {self._handshake_timeout_s:g}s" if handshake
                     else f"idle for {self._idle_timeout_s:g}s")
            raise

    async def _handle_frame(self, link: _Link, header_bytes: bytes) -> bool:
        """Parse one frame's header, then land or refuse its payload and ack. False for a frame refused
        as malformed or unauthenticated: one that does not count as a sender's first valid frame."""
        try:
            header = KVHeader.from_bytes(header_bytes)
            self.phases.mark(header.request_id, "header_in")
            buffer = self._table.admit(header)
        except TransferError as refused:
            code = refused.code if isinstance(refused, FrameRefused) else Refusal.MALFORMED
            await self._refuse(link, code, str(refused))
            return code not in (Refusal.MALFORMED, Refusal.UNAUTHENTICATED)
        self.phases.mark(header.request_id, "admitted")
        code = await self._land(link, header, buffer)
        if not link.closed:  # `cancel` aborts the endpoint: its sender sees the link drop instead
            await link.send(bytearray([code]), self._timeout_s)
            self.phases.mark(header.request_id, "ack_out")
        return True

    async def _recv_opening(self, link: _Link, probe: Any) -> bytes:
        """A frame's first message (length prefix and header, probed off the queue): the header, or b""
        (refused as malformed) when the message is too long or its prefix is not the header's length."""
        length, longest = int(probe.length), PREFIX.size + MAX_HEADER_BYTES + 1  # + 1: one too long is refused
        opening = bytearray(max(1, min(length, longest)))
        try:
            await link.recv_probed(opening, probe, self._timeout_s)
        except _ucx_errors().UCXMessageTruncatedError:
            return b""  # longer than any header: discarded by UCX, refused here
        if not PREFIX.size <= length <= longest or PREFIX.unpack_from(opening)[0] != length - PREFIX.size:
            return b""
        return bytes(opening[PREFIX.size:length])

    async def _refuse(self, link: _Link, code: Refusal, reason: str) -> None:
        """Drain a refused frame's payload into scratch and ack the refusal."""
        log.warning("%s refused a frame: %s", self.address, reason)
        await self._drain(link)
        await link.send(bytearray([code]), self._timeout_s)

    async def _drain(self, link: _Link) -> None:
        """Consume the next message into a 1-byte scratch buffer; UCX drops the rest (truncated)."""
        try:
            await link.recv(bytearray(1), self._timeout_s)
        except _ucx_errors().UCXMessageTruncatedError:
            pass

    async def _land(self, link: _Link, header: KVHeader, buffer: KVBytes) -> Refusal:
        """Receive the admitted payload straight into `buffer` (or, for an in-place frame, the marker
        saying the sender wrote it into the buffer's segment); returns the ack code.

        A transport error or timeout fails the transfer and aborts the endpoint (raised on).
        """
        request_id = header.request_id
        self._receiving[request_id] = link
        in_place = header.in_place and self._in_place.get(request_id) == header.token
        try:
            # An in-place frame's marker comes once the sender copied the frame: its deadline is a payload's.
            probe = await link.next_message(remove=True, timeout_s=_payload_timeout(self._timeout_s, header.nbytes)
                                            if in_place else self._timeout_s)
            self.phases.mark(request_id, "marker_in")
            expected = len(WRITTEN) if in_place else buffer.nbytes
            if probe.length != expected or header.in_place != in_place:
                await self._discard(link, probe)
                reason = (f"payload of {probe.length} bytes for a buffer of {buffer.nbytes}" if not header.in_place
                          else f"an in-place frame for {request_id!r}, whose buffer is no shared-memory segment"
                          if not in_place else f"an in-place frame's marker of {probe.length} bytes")
                self._table.fail(request_id, FrameRefused(Refusal.WRONG_SIZE, reason))
                log.warning("%s refused a frame: %s", self.address, reason)
                return Refusal.WRONG_SIZE
            landing = bytearray(len(WRITTEN)) if in_place else buffer
            await link.recv_probed(landing, probe, _payload_timeout(self._timeout_s, buffer.nbytes))
        except Exception as error:
            self._fail_landing(link, request_id, error)
            raise
        finally:
            self._receiving.pop(request_id, None)
        if not self._table.is_live(request_id, buffer):
            return Refusal.CANCELLED  # cancelled while its size was being checked
        self._table.complete(header)
        self.phases.mark(request_id, "landed")
        return Refusal.OK

    def _fail_landing(self, link: _Link, request_id: str, error: BaseException) -> None:
        """A payload receive broke: abort the endpoint first (no late bytes), then fail the future."""
        link.abort()
        if self._table.state(request_id) is TransferState.RECEIVING:
            self._table.fail(request_id, TransferError(f"receiving {request_id!r} failed: {error!r}"))

    async def _discard(self, link: _Link, probe: Any) -> None:
        """Drop a probed message without writing it anywhere but a 1-byte scratch buffer."""
        try:
            await link.recv_probed(bytearray(1), probe, self._timeout_s)
        except _ucx_errors().UCXMessageTruncatedError:
            pass


def _ucx_errors() -> Any:
    return init_ucx().exceptions


class UCXSender:
    """`KVSender` over ucxx endpoints, pooled per address (one transfer per endpoint at a time). A
    payload may be host bytes or, where `carries_device_memory`, GPU bytes sent with no host copy."""

    def __init__(self, timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 max_endpoints_per_peer: int = 4, transports: str | None = None, shared_memory: bool = True,
                 segment_dir: str = shm.SHM_DIR, max_idle_s: float = IDLE_TIMEOUT_S / 2) -> None:
        self._timeout_s = timeout_s
        self._max_idle_s = max_idle_s  # a pooled endpoint idle longer is closed here, before the receiver does
        self._connect_timeout_s = connect_timeout_s
        self._max_endpoints = max_endpoints_per_peer
        self._transports = transports
        self._idle: dict[str, list[_Link]] = {}
        self._busy: set[_Link] = set()
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._linked: set[str] = set()  # peers this sender has connected to (logged once each)
        # Receivers on this host get payloads through shared memory (`shm.py`), unless this is off.
        self._host = shm.host_identity() if shared_memory else ""
        self._segment_dir = segment_dir
        self._mappings = shm.Mappings()
        self.phases = PhaseLog()  # timestamps of each frame's steps, when on (benchmarks/kv_transfer.py)
        self._closed = False

    @property
    def carries_device_memory(self) -> bool:
        return ucx_carries_device_memory(self._transports)

    async def start(self) -> None:
        """Import and initialise UCX now (about half a second), with this loop's progress driver: not
        on the first send, where it would hold the first prompts' second tokens after every start of
        the worker."""
        init_ucx(self._transports)
        _Progress.of(asyncio.get_running_loop())

    def transport_to(self, address: str, landing: str = "") -> str:
        """"shm" when the receiver at `address` is on this host (its address names this host's
        identity), shared memory is on and (given the transfer's `landing`, its ticket's) the
        receiver's segment of that name is there; else "ucx" (UCX's transports: TCP here)."""
        same = shm.SameHost.of(address)
        if not self._host or same is None or same.host != self._host:
            return shm.TRANSPORT_UCX
        if landing:
            try:
                path = shm.segment_path(same.receiver_id, landing, self._segment_dir)
            except TransferError:
                return shm.TRANSPORT_UCX
            return shm.TRANSPORT_SHM if os.path.exists(path) else shm.TRANSPORT_UCX
        return shm.TRANSPORT_SHM

    async def send(self, address: str, header: KVHeader, payload: KVBytes, landing: str = "") -> str:
        """Deliver one frame; returns once the payload landed in the receiver's buffer, with the
        transport it took: "shm" (written into the receiver's segment named `landing`, the ticket's,
        on this host) or "ucx".

        Raises TransferError if the receiver is unreachable, dies, times out or refuses the frame
        (then `FrameRefused`, with its code); ValueError if `payload` differs from `header.nbytes`.
        A receiver on this host without a segment for the transfer gets it over UCX.
        """
        payload = checked_payload(header, payload)
        self.phases.mark(header.request_id, "send")
        path = self._segment_of(address, header, payload, landing)
        async with contextlib.AsyncExitStack() as mapped:
            try:
                target = None if path is None else await mapped.enter_async_context(
                    self._mappings.window(path, header.first_block * header.block_nbytes, header.nbytes))
            except OSError as error:  # none for this transfer (ordinary memory, a GPU buffer), or unusable
                log.debug("no shared-memory segment for %s at %s (%s): sending it over UCX",
                          header.request_id, address, error)
                target = None
            if target is not None:
                self.phases.mark(header.request_id, "mapped")
                await self.send_raw(address, replace(header, in_place=True).to_bytes(), payload,
                                    write=lambda: shm.copy_in_chunks(target, host_only(payload)),
                                    request_id=header.request_id)
                return shm.TRANSPORT_SHM
        await self.send_raw(address, header.to_bytes(), payload, request_id=header.request_id)
        return shm.TRANSPORT_UCX

    def _segment_of(self, address: str, header: KVHeader, payload: KVBytes, landing: str) -> str | None:
        """The receiver's segment for this transfer, if it is on this host and the payload in host memory."""
        if (is_device_bytes(payload) or not header.token or not landing
                or self.transport_to(address) != shm.TRANSPORT_SHM):
            return None
        same = shm.SameHost.of(address)
        assert same is not None
        try:
            return shm.segment_path(same.receiver_id, landing, self._segment_dir)
        except TransferError:
            return None  # a name that names no file (not hex): over UCX

    async def send_raw(self, address: str, header_bytes: bytes, payload: KVBytes,
                       declared_length: int | None = None,
                       write: Callable[[], Awaitable[None]] | None = None, request_id: str = "") -> None:
        """Send a frame with the header bytes (and length prefix) given as is: tests, diagnostics.
        With `write` (an in-place frame), the payload is not sent: `write()` puts it in place once the
        header is out, and the `WRITTEN` marker follows. `request_id` names the frame's phase marks."""
        if self._closed:
            raise TransferError("the sender is closed")
        slot = self._slots.setdefault(address, asyncio.Semaphore(self._max_endpoints))
        async with slot:
            link = await self._checkout(address)
            code = await self._exchange(link, address, header_bytes, readable_bytes(payload),
                                        len(header_bytes) if declared_length is None else declared_length, write,
                                        request_id)
        if code != Refusal.OK:
            raise FrameRefused(_refusal(code), f"by {address} (ack {code})")

    async def _checkout(self, address: str) -> _Link:
        """An idle live endpoint to `address`, or a new one; raises TransferError if unreachable."""
        idle = self._idle.setdefault(address, [])
        while idle:
            link = idle.pop()
            if not link.closed and time.monotonic() - link.idle_since < self._max_idle_s:
                self._busy.add(link)
                return link
            link.abort()  # the peer went away while it was idle, or it may be about to (its idle timeout)
        link = _Link(await self._connect(address))
        self._busy.add(link)
        return link

    async def _connect(self, address: str) -> Any:
        """A new endpoint, in attempts of a quarter of `connect_timeout_s` (0.5 s at least).

        A connect to a port whose listener just closed sometimes hangs in ucxx's handshake until
        its timeout instead of failing (1 in ~10 here, with or without `_Progress`); a new attempt
        fails at once, so a dead receiver costs one attempt, not the whole connect timeout.
        """
        host, port = parse_address(address)
        ucxx = init_ucx(self._transports)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout_s
        while True:
            attempt_s = min(max(0.5, self._connect_timeout_s / 4), deadline - loop.time())
            try:
                endpoint = await _bounded(ucxx.create_endpoint(host, port, connect_timeout=attempt_s), attempt_s)
                if address not in self._linked:  # once per peer: which link this sender's KV takes
                    self._linked.add(address)
                    log.info("KV link to %s open: %s", address, transports_in_use())
                return endpoint
            except TimeoutError as error:
                if loop.time() + 1e-3 < deadline:
                    continue
                raise TransferError(f"cannot connect to {address}: timed out") from error
            except Exception as error:  # UCX errors; anything else is as fatal to the send
                raise TransferError(f"cannot connect to {address}: {error!r}") from error

    async def _exchange(self, link: _Link, address: str, header_bytes: bytes, payload: KVBytes,
                        length: int, write: Callable[[], Awaitable[None]] | None = None, request_id: str = "") -> int:
        """Send prefix and header (one message) and the payload (or, in place, write it and send the
        marker), wait for the ack; the endpoint goes back to the pool only if the exchange completed
        (a broken one is aborted: its stream is out of step)."""
        ack = bytearray(1)
        try:
            # One round trip: the control messages are posted, not awaited one by one (each wait is a
            # wake-up of this process, as long as a copy of megabytes). The ack's receive is posted
            # before the payload, so the ack completes at the very progress that brings it.
            sends = [link.post_send(bytearray(PREFIX.pack(length) + header_bytes))]
            acked = link.post_recv(ack)
            self.phases.mark(request_id, "header_out")
            if write is None:
                await link.send(payload, _payload_timeout(self._timeout_s, payload.nbytes))
            else:
                await write()  # the header is on its way: a receiver learns of the frame before the copy ends
                self.phases.mark(request_id, "copied")
                sends.append(link.post_send(bytearray(WRITTEN)))
                self.phases.mark(request_id, "marker_out")
            await link.wait(acked, self._timeout_s)
            self.phases.mark(request_id, "acked")
            for request in sends:  # out before the ack came back; raises a send's own error, if any
                await link.wait(request, self._timeout_s)
        except BaseException as error:
            self._busy.discard(link)
            link.abort()
            if isinstance(error, Exception):  # UCX errors, timeouts, an endpoint aborted by `close`
                raise TransferError(f"send to {address} failed: {error!r}") from error
            raise  # CancelledError: the caller gave up on the send
        self._busy.discard(link)
        if self._closed:
            link.abort()
        else:
            link.idle_since = time.monotonic()
            self._idle[address].append(link)
        return ack[0]

    async def close(self) -> None:
        """Abort every pooled and in-flight endpoint; later sends raise TransferError."""
        self._closed = True
        for links in self._idle.values():
            for link in links:
                link.abort()
        self._idle.clear()
        for link in list(self._busy):
            link.abort()
        self._busy.clear()
        await asyncio.sleep(0)
        self._mappings.close()
