"""KV transfer through shared memory between two workers on one host: one memcpy, no socket.

The UCX connector (`ucx.py`) carries the control: a frame's header, a one-byte "written" marker and
the ack travel on the UCX endpoint (TCP) as every frame does, so connects, deadlines, cancellation
and a dead peer are detected exactly as on the TCP path. Only the payload takes another road:

    decode worker (receiver)                        prefill worker (sender), same host
    landing = await receiver.landing_memory(t, n)   (the ticket's address names the receiver's
      a file /dev/shm/pdserve-kv-<rid>-<landing>     host identity and id `rid`: `SameHost`; the
      (<landing>: 128 random bits, not the token;    ticket's `landing`, the segment's name)
       `landing_name(t)`; 0600, fallocated,
      mapped; pooled; a new
      one faulted in on a thread; a decode
      worker makes one per size class at start:
      `prefault_up_to`): the staging tensor
      `import_kv` reads from
    expect(request_id, landing, token)
                                    <── length prefix and header (in_place=True), one UCX
                                        message: posted, the ack's receive posted too,
                                        nothing awaited
    admit: RECEIVING                                map the segment (once: `Mappings`, found again
                                                    by one stat), copy the frame's bytes to its
                                                    offset in chunks (cancellable between chunks;
                                                    streaming stores from 16 MiB: `stream_copy`)
                                    <── 1-byte marker, over UCX (posted)
    complete; ack ──>                               the send returns (one wait: the ack)
    (the transfer's name goes as soon as the transfer ends; the segment is pooled for another
    transfer if this one ended DONE and its view was dropped, else unlinked: `Segments`)

Why this design (docs/performance.md, "KV transfer between two processes"): UCX's own shared memory
transports are used only for endpoints made from a worker address with error handling off, where a
killed peer hangs the sender; here the memory is plain POSIX shared memory and every wait is a UCX
wait with a deadline on an endpoint that has error handling on.

Safety:
- A receiver killed mid-copy: the sender's copy finishes into memory it mapped (the pages live on
  until it unmaps them), then its marker send fails: TransferError, within tens of milliseconds.
- A sender killed mid-copy: the receiver's endpoint fails while the transfer is RECEIVING: the
  transfer fails (the decode worker recomputes), as on the TCP path.
- A cancel on the receiver aborts the endpoint (the sender raises); bytes the sender still copies
  land in that request's own segment only, which nothing reads once the transfer is cancelled and
  which is never handed out again (only the segments of transfers that ended DONE are reused:
  their sender wrote its last byte before its marker).
- No SIGBUS: segments are allocated with `posix_fallocate` before they are mapped (a full /dev/shm
  fails there, cleanly: the receiver falls back to ordinary memory) and never shrink.
- A segment's name is random, never the transfer's token nor anything made from it: any local
  user can list /dev/shm, and the token is what lets a peer land frames. The file is 0600 (the
  workers' user alone opens it), and an in-place frame is taken only with the token in its header,
  checked as every frame's is (`UCXReceiver`).
- Segments of a receiver process that died without unlinking them are removed when another
  receiver starts on the host (their names carry the owner's pid).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import hashlib
import logging
import mmap
import os
import re
import secrets
import socket
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlencode

import numpy as np

from cluster.transfer import stream_copy
from cluster.transfer.connector import TransferError
from cluster.transfer.loopback import is_device_bytes

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdserve-kv-"
# The sender copies a frame in chunks of this many bytes and yields to the event loop between them,
# so that a cancelled send stops within one chunk (~1 ms at memory speed) and the loop stays responsive.
COPY_CHUNK = 8 << 20
# Idle segments a receiver keeps for reuse, and what a sender keeps mapped, at most.
POOL_BYTES = 1 << 30
MAPPED_BYTES = 1 << 30
MIN_SEGMENT = 1 << 20
TRANSPORT_SHM = "shm"
TRANSPORT_UCX = "ucx"
_NAME = re.compile(r"^[0-9a-f]{1,64}$")
_RECEIVER_ID = re.compile(r"^[0-9]{1,10}x[0-9a-f]{8}$")


def host_identity() -> str:
    """This host, as far as shared memory goes: the kernel's boot id, the hostname, and the mount
    and network namespaces (containers or network-namespace "hosts" on one kernel are other hosts:
    their /dev/shm may differ). Never the IP address: two hosts may both be 127.0.0.1 to themselves."""
    parts = [_read("/proc/sys/kernel/random/boot_id"), socket.gethostname()]
    for namespace in ("mnt", "net"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{namespace}").st_ino))
        except OSError:
            parts.append("")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class SameHost:
    """What a receiver's address says about where it is: its host identity and its id (which names
    its segments). Carried in the address's query: ``ucx://10.0.0.5:4242?host=<identity>&rid=<id>``."""

    host: str
    receiver_id: str

    def suffix(self) -> str:
        return "?" + urlencode({"host": self.host, "rid": self.receiver_id})

    @classmethod
    @functools.lru_cache(maxsize=1024)  # parsed once per receiver: a sender asks at every transfer
    def of(cls, address: str) -> SameHost | None:
        """The receiver's identity from its address, or None when it gives none (or a malformed one)."""
        _, _, query = address.partition("?")
        fields = parse_qs(query)
        host, receiver_id = fields.get("host", [""])[0], fields.get("rid", [""])[0]
        if not _NAME.match(host) or not _RECEIVER_ID.match(receiver_id):
            return None
        return cls(host, receiver_id)


def segment_path(receiver_id: str, landing: str, directory: str = SHM_DIR) -> str:
    """Where the receiver `receiver_id` keeps the segment it named `landing` (`Segments.landing_name`)."""
    if not _RECEIVER_ID.match(receiver_id) or not _NAME.match(landing):
        raise TransferError(f"no shared-memory segment can be named for receiver {receiver_id!r}")
    return os.path.join(directory, f"{SEGMENT_PREFIX}{receiver_id}-{landing}")


@dataclass(eq=False, slots=True)
class _Segment:
    """One /dev/shm file and the receiver's mapping of it, handed out for one transfer at a time."""

    memory: mmap.mmap
    path: str  # its current name: a random one per transfer (`segment_path`) while handed out, an idle one between
    landing: str = ""  # the random part of that name while handed out
    view_alive: bool = False  # the view handed out for the current transfer is still referenced
    reusable: bool | None = None  # set when the transfer ends: True if it ended DONE (no writer left)


class Segments:
    """A receiver's landing segments, one per expected transfer (keyed by its token), pooled.

    A segment is handed out again only once (a) its transfer ended DONE, so its sender wrote its
    last byte before its marker and writes no more, and (b) the view handed out is gone (the decode
    worker imported the KV). One whose transfer failed or was cancelled may still be written by a
    sender that has not noticed yet: it is unlinked and never handed out again. Reuse is what
    makes this fast: a fresh segment costs its pages' zeroing here, and each sender maps a segment
    once (`Mappings`, keyed by inode) instead of once per transfer.
    """

    def __init__(self, directory: str = SHM_DIR, pool_bytes: int = POOL_BYTES) -> None:
        self.directory = directory
        self.receiver_id = f"{os.getpid()}x{secrets.token_hex(4)}"
        self._pool_bytes = pool_bytes
        self._live: dict[str, _Segment] = {}  # token -> segment, until the transfer ends
        self._spans: dict[str, tuple[int, int]] = {}  # token -> (address, size) of the view handed out
        self._idle: list[_Segment] = []
        self._made = 0  # segments made so far (names the idle ones)
        self._making: set[str] = set()  # tokens whose segment is being made on a thread
        self._closed = False

    async def allocate(self, token: str, nbytes: int) -> memoryview | None:
        """A writable view of `nbytes` in a segment for the transfer with `token`, or None when shared
        memory cannot hold it (no /dev/shm, full: the caller uses ordinary memory).

        A pooled segment comes at once; a new one is allocated and faulted in on a thread (its pages
        zeroed, its page tables filled: tens of milliseconds for a large one), not on the caller's
        event loop."""
        if nbytes <= 0 or token in self._live or token in self._making:
            return None
        segment = self._take_idle(size_class(nbytes))
        if segment is None:
            segment = await self._make_off_loop(token, size_class(nbytes))
            if segment is None or self._closed or token in self._live:
                if segment is not None:
                    _unlink(segment.path)
                return None
        return self._hand_out(token, nbytes, segment)

    async def prefault(self, nbytes: int, count: int = 1) -> int:
        """Make `count` segments for transfers of `nbytes` ahead of need (on a thread) and pool them,
        as far as the pool holds them; returns how many were pooled. A decode worker's first
        transfers of that size then take pooled ones, as later transfers do."""
        pooled = 0
        for _ in range(count):
            size = size_class(nbytes)
            if self.pooled_bytes + size > self._pool_bytes:
                break
            segment = await self._make_off_loop("", size)
            if segment is None:
                break
            segment.reusable = not self._closed  # never handed out: nobody writes into it
            self._recycle(segment)
            pooled += segment in self._idle
        return pooled

    async def prefault_up_to(self, largest: int) -> int:
        """One segment of each size class from the smallest up to `largest`'s, made ahead of need (on a
        thread, smallest first, as far as the pool holds them); returns how many were pooled. A
        decode worker makes them at start (`UCXReceiver.prefault_landing_up_to`): its first
        transfers of any size up to `largest` then take pooled segments instead of faulting new ones
        in on their reservation's critical path."""
        pooled = 0
        for size in (MIN_SEGMENT << shift for shift in range((size_class(largest) // MIN_SEGMENT).bit_length())):
            if any(len(idle.memory) == size for idle in self._idle):
                continue  # one of this class is pooled already
            made = await self.prefault(size)
            if made == 0:
                break  # the pool is full (or /dev/shm is): larger ones would not fit either
            pooled += made
        return pooled

    def _hand_out(self, token: str, nbytes: int, segment: _Segment) -> memoryview | None:
        # A fresh random name per transfer: a sender told an earlier one cannot reach this transfer's
        # bytes, and nothing in /dev/shm tells the token.
        landing = secrets.token_hex(16)
        path = segment_path(self.receiver_id, landing, self.directory)
        try:
            os.rename(segment.path, path)  # the name this transfer's sender opens (its ticket's `landing`)
        except OSError as error:
            log.warning("shared-memory landing segment unusable (%s): KV lands in ordinary memory", error)
            _unlink(segment.path)
            return None
        segment.path, segment.landing, segment.view_alive, segment.reusable = path, landing, True, None
        view = memoryview(segment.memory)[:nbytes]
        weakref.finalize(view, self._view_gone, segment)
        self._live[token], self._spans[token] = segment, (address_of(view), nbytes)
        return view

    async def _make_off_loop(self, token: str, size: int) -> _Segment | None:
        """A new segment, made on a thread. If the caller gives up meanwhile (its task cancelled),
        the segment still goes to the pool once made: nobody wrote into it."""
        self._made += 1
        path = os.path.join(self.directory, f"{SEGMENT_PREFIX}{self.receiver_id}-idle{self._made}")
        self._making.add(token)
        made = asyncio.get_running_loop().run_in_executor(None, make_segment, path, size)
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            made.add_done_callback(self._pool_abandoned)
            raise
        finally:
            self._making.discard(token)

    def _pool_abandoned(self, made: asyncio.Future[_Segment | None]) -> None:
        segment = None if made.cancelled() or made.exception() is not None else made.result()
        if segment is not None:
            segment.reusable = not self._closed  # fresh, never handed out: reusable unless closing
            self._recycle(segment)

    def _take_idle(self, size: int) -> _Segment | None:
        for index, segment in enumerate(self._idle):
            if len(segment.memory) == size:
                return self._idle.pop(index)
        return None

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the idle segments kept for reuse."""
        return sum(len(idle.memory) for idle in self._idle)

    def holds(self, token: str) -> bool:
        return token in self._live

    def landing_name(self, token: str) -> str:
        """The name of the segment handed out for the transfer with `token` ("" if none): what its
        sender opens (`segment_path`), given in the ticket. Random, not a secret: a name any local
        user sees in /dev/shm, which tells nothing of the token."""
        segment = self._live.get(token)
        return segment.landing if segment is not None else ""

    def covers(self, token: str, buffer: object) -> bool:
        """Whether `buffer` is exactly the view allocated for `token` (so that what a sender writes
        into the segment is what the receiver's caller reads)."""
        span = self._spans.get(token)
        if span is None or is_device_bytes(buffer):
            return False
        view = memoryview(buffer)  # type: ignore[arg-type]
        return view.c_contiguous and (address_of(view), view.nbytes) == span

    def release(self, token: str, reusable: bool = False) -> None:
        """The transfer ended (`reusable`: DONE): its token's name goes at once, so no sender opens the
        segment for it any more; the segment is pooled once its view is gone too, if `reusable`."""
        segment = self._live.pop(token, None)
        self._spans.pop(token, None)
        if segment is None:
            return
        segment.reusable, segment.landing = reusable, ""
        if reusable:
            idle = segment.path.rpartition("-")[0] + f"-idle{id(segment):x}"
            os.rename(segment.path, idle)
            segment.path = idle
        else:
            _unlink(segment.path)
        self._recycle(segment)

    def _view_gone(self, segment: _Segment) -> None:
        segment.view_alive = False
        self._recycle(segment)

    def _recycle(self, segment: _Segment) -> None:
        if segment.view_alive or segment.reusable is None:
            return  # still in use, by the transfer or by whoever holds the view
        if segment.reusable and self.pooled_bytes + len(segment.memory) <= self._pool_bytes:
            self._idle.append(segment)
            return
        _unlink(segment.path)  # not reusable, or the pool is full: the memory goes with the last mapping

    def close(self) -> None:
        """Unlink every segment's name (views handed out stay valid until dropped); one still being
        made is unlinked when it is."""
        self._closed = True
        for token in list(self._live):
            self.release(token)
        for segment in self._idle:
            _unlink(segment.path)
        self._idle.clear()

    def remove_orphans(self) -> int:
        """Unlink segments whose owner process is gone (a receiver killed before it unlinked them)."""
        removed = 0
        for name in _listdir(self.directory):
            if not name.startswith(SEGMENT_PREFIX):
                continue
            pid = name[len(SEGMENT_PREFIX):].partition("x")[0]
            if pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))
                    removed += 1
        return removed


def size_class(nbytes: int) -> int:
    """Segments come in powers of two from 1 MiB, so that one serves transfers of different sizes."""
    return max(MIN_SEGMENT, 1 << (nbytes - 1).bit_length())


def make_segment(path: str, size: int) -> _Segment | None:
    """A new segment file at `path`, allocated and mapped with its pages faulted in (so that neither
    the sender's copy nor `import_kv` faults them later), or None if /dev/shm cannot hold it. Blocks
    for as long as the kernel zeroes the pages: run it on a thread (`Segments.allocate` does)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        log.warning("no shared-memory landing segment (%s): KV lands in ordinary memory", error)
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # every page allocated now: no SIGBUS on a full /dev/shm later
        memory = map_populated(fd, size)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(path)
        log.warning("no shared-memory landing segment of %d bytes (%s): KV lands in ordinary memory", size, error)
        return None
    finally:
        os.close(fd)
    return _Segment(memory, path)


def map_populated(fd: int, size: int) -> mmap.mmap:
    """`size` bytes of the file `fd`, mapped shared and writable, with every page table entry filled
    now, so that the copy into it does not fault page by page.

    Filled by madvise(MADV_POPULATE_WRITE) through ctypes, which lets go of the GIL: on a thread, the
    event loop runs meanwhile (mmap's own MAP_POPULATE holds the GIL throughout, on Python 3.11).
    Kernels before 5.14 lack it: the pages are then touched one by one (numpy, also without the GIL)."""
    memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    pages = np.frombuffer(memory, dtype=np.uint8)
    if _madvise(pages.ctypes.data, size, MADV_POPULATE_WRITE) != 0:
        pages[::mmap.PAGESIZE].max()  # a read fault maps each (allocated) page
    del pages  # no export left: the mapping can be closed later
    return memory


MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14


def _madvise(address: int, size: int, advice: int) -> int:
    global _libc_madvise
    if _libc_madvise is None:
        function = ctypes.CDLL(None, use_errno=True).madvise
        function.argtypes, function.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        _libc_madvise = function
    return int(_libc_madvise(address, size, advice))


_libc_madvise: Any = None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Mappings:
    """A sender's mappings of receivers' segments, by inode, so that a pooled segment is mapped (its
    page tables filled, on a thread) once, not for every transfer. Least recently used ones are
    unmapped beyond `max_bytes` (a mapping keeps its segment's memory alive after the receiver let
    it go)."""

    def __init__(self, max_bytes: int = MAPPED_BYTES) -> None:
        self._max_bytes = max_bytes
        self._maps: OrderedDict[tuple[int, int], mmap.mmap] = OrderedDict()

    @contextlib.asynccontextmanager
    async def window(self, path: str, offset: int, nbytes: int) -> AsyncIterator[memoryview]:
        """Bytes [offset, offset + nbytes) of the segment at `path`, writable. FileNotFoundError if
        there is none (gone, or not on this host); TransferError if the range is not inside it
        (never mapped past the file's end: that would be SIGBUS)."""
        status = os.stat(path)  # a pooled segment mapped before: found by inode, no open (one syscall)
        if offset < 0 or nbytes <= 0 or offset + nbytes > status.st_size:
            raise TransferError(f"frame of bytes [{offset}, {offset + nbytes}) does not fit the receiver's "
                                f"segment of {status.st_size}")
        key = (status.st_dev, status.st_ino)
        memory = self._maps.pop(key, None)
        if memory is None or len(memory) != status.st_size:  # a new one: opened (0600: the receiver's
            memory = await self._map(path, status)  # user only) and its page tables filled, on a thread
        self._maps[key] = memory  # most recently used last
        self._evict()
        view = memoryview(memory)[offset:offset + nbytes]
        try:
            yield view
        finally:
            view.release()

    @staticmethod
    async def _map(path: str, status: os.stat_result) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR)
        try:
            now = os.fstat(fd)
            if (now.st_dev, now.st_ino, now.st_size) != (status.st_dev, status.st_ino, status.st_size):
                raise FileNotFoundError(f"{path} changed while it was being opened")
            return await asyncio.to_thread(map_populated, fd, status.st_size)
        finally:
            os.close(fd)

    def _evict(self) -> None:
        while len(self._maps) > 1 and sum(len(memory) for memory in self._maps.values()) > self._max_bytes:
            _, memory = self._maps.popitem(last=False)
            with contextlib.suppress(BufferError):  # a window still open on it: unmapped when it goes
                memory.close()

    def close(self) -> None:
        for memory in self._maps.values():
            with contextlib.suppress(BufferError):
                memory.close()
        self._maps.clear()


def address_of(view: memoryview) -> int:
    """Where a host buffer's first byte lives."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, and not ours to clean up
    return True


async def copy_in_chunks(target: memoryview, payload: memoryview) -> None:
    """Copy `payload` into `target` (as long), yielding to the event loop between chunks: a cancelled
    send stops there, and the loop stays responsive during a large frame. A large frame is copied with
    streaming stores (`stream_copy`): the segment is memory this process has not written lately."""
    streaming = stream_copy.streams(payload.nbytes)
    if streaming:
        await stream_copy.ready()
    for start in range(0, payload.nbytes, COPY_CHUNK):
        stop = min(start + COPY_CHUNK, payload.nbytes)
        stream_copy.copy(target[start:stop], payload[start:stop], streaming)
        if stop < payload.nbytes:
            await asyncio.sleep(0)
