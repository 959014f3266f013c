"""The streaming-store copy into landing segments (cluster/transfer/stream_copy.py): exact bytes for
every length and alignment, nothing written outside the target, bad arguments refused."""

from __future__ import annotations

import asyncio
import ctypes
import platform

import numpy as np
import pytest

from cluster.transfer import stream_copy
from pdserve_kernels import cpu_build

# Lengths around the C loop's 128-byte steps and the 64-byte head, and a few MiB.
LENGTHS = [0, 1, 63, 64, 65, 127, 128, 129, 1000, 4096 + 5, (1 << 20) - 1, 1 << 20, (3 << 20) + 17]
OFFSETS = [(0, 0), (1, 0), (0, 3), (31, 7), (64, 64), (17, 63)]  # (target's, source's) misalignment


@pytest.fixture(scope="module")
def library() -> ctypes.CDLL:
    asyncio.run(stream_copy.ready())
    lib = stream_copy.library()
    if lib is None:
        pytest.skip("no C compiler here: the copy is a plain one")
    return lib


@pytest.fixture(scope="module", params=["native", "x86-64"], ids=["this-cpu", "sse2-only"])
def built_for(request: pytest.FixtureRequest, library: ctypes.CDLL) -> ctypes.CDLL:
    """The copy built for this CPU (AVX2 where it has it) and for a plain x86-64 one (its SSE2 loop)."""
    if request.param == "native":
        return library
    if platform.machine() != "x86_64":
        pytest.skip("not an x86-64 machine")
    lib = cpu_build.load(stream_copy.SOURCE, request.param)
    assert lib is not None, "a compiler that builds for this CPU builds for plain x86-64 too"
    lib.stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return lib


def around(length: int, offset: int, seed: int) -> np.ndarray:
    """Random bytes with `offset` bytes before and 64 after the `length` the copy should touch."""
    return np.random.default_rng(seed).integers(0, 256, offset + length + 64, dtype=np.uint8)


@pytest.mark.parametrize("length", LENGTHS)
def test_the_copy_is_exact_and_stays_inside_its_target(built_for: ctypes.CDLL, length: int) -> None:
    for target_offset, source_offset in OFFSETS:
        target, source = around(length, target_offset, 1), around(length, source_offset, 2)
        before = target.copy()
        window = memoryview(target)[target_offset:target_offset + length]
        payload = memoryview(source)[source_offset:source_offset + length]
        def through_c(target: memoryview, source: memoryview) -> None:  # the C path at every length too
            built_for.stream_copy(stream_copy._address(target), stream_copy._address(source), source.nbytes)

        for copy in (stream_copy.copy, through_c, lambda t, s: stream_copy.copy(t, s, streaming=False)):
            target[:] = before
            copy(window, payload)
            assert np.array_equal(target[target_offset:target_offset + length],
                                  source[source_offset:source_offset + length]), (length, target_offset, source_offset)
            assert np.array_equal(target[:target_offset], before[:target_offset])
            assert np.array_equal(target[target_offset + length:], before[target_offset + length:])


def test_large_frames_take_the_streaming_path_once_ready(library: ctypes.CDLL) -> None:
    assert stream_copy._loaded() is library  # what `copy` uses when streaming
    assert stream_copy.streams(16 << 20) and not stream_copy.streams(4 << 20)


def test_a_copy_of_another_length_or_into_read_only_memory_is_refused() -> None:
    source = np.arange(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="99"):
        stream_copy.copy(memoryview(np.zeros(99, dtype=np.uint8)), memoryview(source))
    with pytest.raises(ValueError, match="read-only"):
        stream_copy.copy(memoryview(bytes(100)), memoryview(source))
