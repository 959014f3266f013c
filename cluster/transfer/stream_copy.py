"""The copy of a frame into a receiver's landing segment, with stores that bypass the caches.

Why: the destination is a pooled segment this process has not written lately. With ordinary stores
(glibc's memcpy) every destination line is first read from memory (read for ownership), then
written back: three memory transfers per byte. Non-temporal stores write whole lines without reading
them: two, so the copy into a segment takes about a quarter less time (docs/performance.md, "KV
transfer between two processes"). glibc switches to such stores itself only above its
`x86_non_temporal_threshold`, which it derives from the shared cache the CPU reports: on VMs that
report a large one, never for KV frames.
The cost: the receiver then reads the KV from memory, not from the last-level cache where a plain
copy may have left part of it when both processes share it. Copying then reading back, frames of up
to 16 MiB come out a little faster plain, larger ones faster streaming; the copy alone (what the
sender waits for) is faster streaming at every size. So frames from `STREAM_MIN` on stream, smaller ones
stay plain.

The C (`stream_copy.c`) is compiled at first use by `pdserve_kernels.cpu_build` (its cache is per machine);
`ready()` does that off the event loop. Where it cannot be built (no compiler, not x86-64: a plain
memcpy there), the copy is a plain one.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
from pathlib import Path

import numpy as np

from pdserve_kernels import cpu_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("stream_copy.c")
# Frames below this are copied plainly: the receiver's read of them gains more from the cache than
# the sender's copy loses (measurements above).
STREAM_MIN = 16 << 20


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled copy, or None where it cannot be built (then `copy` is a plain one). Blocks for the
    build the first time on a machine (~0.3 s): call it from a thread (`ready`)."""
    if not SOURCE.exists():  # an install without it (package data): plain copies
        log.info("%s is not installed: KV copies into shared memory are plain ones", SOURCE.name)
        return None
    lib = cpu_build.load(SOURCE)
    if lib is not None:
        lib.stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.stream_copy.restype = None
    return lib


async def ready() -> None:
    """Load `library()` (building it the first time on a machine) on a thread, once per process."""
    if not library.cache_info().currsize:
        await asyncio.to_thread(library)


def _loaded() -> ctypes.CDLL | None:
    """`library()` if it was loaded already (never a build here: this may run on the event loop)."""
    return library() if library.cache_info().currsize else None


def copy(target: memoryview, source: memoryview, streaming: bool = True) -> None:
    """`target[:] = source`: both contiguous host memory of the same length, `target` writable and
    not overlapping `source`. With streaming stores if `streaming` (callers copying a frame in parts
    pass `streaming(frame's size)`) and `library()` was loaded (`ready`)."""
    if target.nbytes != source.nbytes or target.readonly:
        raise ValueError(f"cannot copy {source.nbytes} bytes into a {'read-only ' * target.readonly}"
                         f"buffer of {target.nbytes}")
    lib = _loaded() if streaming else None
    if lib is None:
        target[:] = source
        return
    lib.stream_copy(_address(target), _address(source), source.nbytes)  # ctypes lets go of the GIL


def streams(nbytes: int) -> bool:
    """Whether a frame of `nbytes` is copied with streaming stores."""
    return nbytes >= STREAM_MIN


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
