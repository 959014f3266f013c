"""KV transfer through shared memory between two workers on one host: one memcpy, no socket.

The UCX connector (`ucx.py`) carries the control: a frame's header, a one-byte "written" marker and
the ack travel on the same UCX endpoint (TCP) as before, so connects, deadlines, cancellation and a
dead peer are detected exactly as on the TCP path. Only the payload takes another road:

    decode worker (receiver)                        prefill worker (sender), same host
    landing = receiver.landing_memory(token, n)     (the ticket's address names the receiver's
      a file /dev/shm/pdserve-kv-<rid>-<token>       host identity and id `rid`: `SameHost`)
      (0600, fallocated, mapped): the staging
      tensor `import_kv` reads from
    expect(request_id, landing, token)
                                    <── header (in_place=True), over UCX
    admit: RECEIVING                                map the segment, copy the frame's bytes to its
                                                    offset in chunks (cancellable between chunks)
                                    <── 1-byte marker, over UCX
    complete; ack ──>                               the send returns
    (the segment's name is unlinked as soon as the transfer ends, whatever the outcome)

Why this design (docs/performance.md, "KV transfer between two processes"): UCX's own shared memory
transports are used only for endpoints made from a worker address with error handling off, where a
killed peer hangs the sender; here the memory is plain POSIX shared memory and every wait is a UCX
wait with a deadline on an endpoint that has error handling on. vLLM's and NIXL's same-host paths
(CUDA IPC handles, UCX sm/cma) likewise separate the bulk copy from a control channel.

Safety:
- A receiver killed mid-copy: the sender's copy finishes into memory it mapped (the pages live on
  until it unmaps them), then its marker send fails: TransferError, within tens of milliseconds.
- A sender killed mid-copy: the receiver's endpoint fails while the transfer is RECEIVING: the
  transfer fails (the decode worker recomputes), as on the TCP path.
- A cancel on the receiver aborts the endpoint (the sender raises); bytes the sender still copies
  land in that request's own segment only, which nothing reads once the transfer is cancelled and
  which is never reused (one segment per transfer, its name unlinked at the end).
- No SIGBUS: segments are allocated with `posix_fallocate` before they are mapped (a full /dev/shm
  fails there, cleanly: the receiver falls back to ordinary memory) and never shrink.
- A segment is opened by name only: the name holds the transfer's secret token, the file is 0600.
- Segments of a receiver process that died without unlinking them are removed when another
  receiver starts on the host (their names carry the owner's pid).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import mmap
import os
import re
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import parse_qs, urlencode

import numpy as np

from cluster.transfer.connector import TransferError
from cluster.transfer.loopback import is_device_bytes

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdserve-kv-"
# The sender copies a frame in chunks of this many bytes and yields to the event loop between them,
# so that a cancelled send stops within one chunk (~1 ms at memory speed) and the loop stays responsive.
COPY_CHUNK = 8 << 20
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
    def of(cls, address: str) -> SameHost | None:
        """The receiver's identity from its address, or None when it gives none (or a malformed one)."""
        _, _, query = address.partition("?")
        fields = parse_qs(query)
        host, receiver_id = fields.get("host", [""])[0], fields.get("rid", [""])[0]
        if not _NAME.match(host) or not _RECEIVER_ID.match(receiver_id):
            return None
        return cls(host, receiver_id)


def segment_path(receiver_id: str, token: str, directory: str = SHM_DIR) -> str:
    if not _RECEIVER_ID.match(receiver_id) or not _NAME.match(token):
        raise TransferError(f"no shared-memory segment can be named for receiver {receiver_id!r}")
    return os.path.join(directory, f"{SEGMENT_PREFIX}{receiver_id}-{token}")


class Segments:
    """A receiver's landing segments, one per expected transfer (keyed by its token)."""

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.directory = directory
        self.receiver_id = f"{os.getpid()}x{secrets.token_hex(4)}"
        self._paths: dict[str, str] = {}  # token -> path, until the transfer ends
        self._spans: dict[str, tuple[int, int]] = {}  # token -> (address, size) of the receiver's mapping

    def allocate(self, token: str, nbytes: int) -> memoryview | None:
        """A writable view of a new segment of `nbytes` for the transfer with `token`, or None when
        shared memory cannot hold it (no /dev/shm, full: the caller uses ordinary memory)."""
        if nbytes <= 0 or token in self._paths:
            return None
        path = segment_path(self.receiver_id, token, self.directory)
        # Made under a temporary name and renamed once whole: a sender never sees a short segment.
        making = f"{path}.new"
        try:
            fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            log.warning("no shared-memory landing segment (%s): KV lands in ordinary memory", error)
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)  # allocate every page now: no SIGBUS on a full /dev/shm later
            memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            os.rename(making, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.unlink(making)
            log.warning("no shared-memory landing segment of %d bytes (%s): KV lands in ordinary memory",
                        nbytes, error)
            return None
        finally:
            os.close(fd)
        view = memoryview(memory)
        self._paths[token], self._spans[token] = path, (address_of(view), nbytes)
        return view

    def holds(self, token: str) -> bool:
        return token in self._paths

    def covers(self, token: str, buffer: object) -> bool:
        """Whether `buffer` is exactly the segment allocated for `token` (so that what a sender writes
        into the segment is what the receiver's caller reads)."""
        span = self._spans.get(token)
        if span is None or is_device_bytes(buffer):
            return False
        view = memoryview(buffer)  # type: ignore[arg-type]
        return view.c_contiguous and (address_of(view), view.nbytes) == span

    def release(self, token: str) -> None:
        """The transfer ended: unlink its segment's name (the memory goes with its last mapping)."""
        path = self._paths.pop(token, None)
        self._spans.pop(token, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def close(self) -> None:
        for token in list(self._paths):
            self.release(token)

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


@contextlib.contextmanager
def mapped(path: str, offset: int, nbytes: int) -> Iterator[memoryview]:
    """Bytes [offset, offset + nbytes) of an existing segment, mapped for writing (page tables filled
    at once: one call instead of a page fault per 4 KiB). FileNotFoundError if the segment is gone
    (or was never on this host); TransferError if the range is not inside it (never mapped past
    the file's end: that would be SIGBUS)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if offset < 0 or nbytes <= 0 or offset + nbytes > size:
            raise TransferError(f"frame of bytes [{offset}, {offset + nbytes}) does not fit the receiver's "
                                f"segment of {size}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
        memory = mmap.mmap(fd, offset + nbytes - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           offset=start)
    finally:
        os.close(fd)
    view = memoryview(memory)[offset - start:]
    try:
        yield view
    finally:
        view.release()  # else `close` refuses: a view is still exported
        memory.close()


async def copy_in_chunks(target: memoryview, payload: memoryview) -> None:
    """Copy `payload` into `target` (as long), yielding to the event loop between chunks: a cancelled
    send stops there, and the loop stays responsive during a large frame."""
    for start in range(0, payload.nbytes, COPY_CHUNK):
        stop = min(start + COPY_CHUNK, payload.nbytes)
        target[start:stop] = payload[start:stop]
        if stop < payload.nbytes:
            await asyncio.sleep(0)
