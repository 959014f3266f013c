"""What an aborted UCX endpoint or an early-ended handshake leaves behind: memory UCX may still write
is kept alive, so a late write never lands in memory Python freed and reused. (With fakes for the
requests and the progress: the real race needs a machine slow enough to lose it.)"""

from __future__ import annotations

import asyncio
import gc
import struct
import weakref
from dataclasses import dataclass
from typing import Any

import pytest

from tests.transfer.conftest import HAS_UCXX

pytestmark = pytest.mark.skipif(not HAS_UCXX, reason="ucxx is not installed (pip install ucxx-cu13)")


@dataclass
class Request:
    completed: bool = False


class Buffer(bytearray):
    """A bytearray that a weak reference can watch."""


class Progress:
    def __init__(self, request: Request, completes_after: int | None) -> None:
        self.request, self.completes_after, self.calls = request, completes_after, 0

    def progress_now(self) -> None:
        self.calls += 1
        if self.completes_after is not None and self.calls >= self.completes_after:
            self.request.completed = True


class Endpoint:
    closed = False

    def abort(self) -> None:
        self.closed = True


def aborted_link(monkeypatch: pytest.MonkeyPatch, completes_after: int | None) -> tuple[Any, Request, Any]:
    from cluster.transfer import ucx

    monkeypatch.setattr(ucx, "SETTLE_S", 0.0)  # the process ran late: the deadline has passed already
    monkeypatch.setattr(ucx, "_UNSETTLED", [])
    request, buffer = Request(), Buffer(8)
    link = ucx._Link.__new__(ucx._Link)
    link.endpoint, link._progress = Endpoint(), Progress(request, completes_after)
    link._pending = [(request, buffer)]
    watcher = weakref.ref(buffer)
    del buffer
    link.abort()
    link._pending = []  # as the coroutine that awaited it is gone
    gc.collect()
    return ucx, request, watcher


def test_a_request_the_flush_finishes_releases_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    ucx, request, watcher = aborted_link(monkeypatch, completes_after=3)
    assert request.completed and not ucx._UNSETTLED and watcher() is None


def test_a_request_still_in_flight_keeps_its_memory_until_it_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    ucx, request, watcher = aborted_link(monkeypatch, completes_after=None)
    assert not request.completed and watcher() is not None  # UCX may still write there: not freed
    request.completed = True
    other = ucx._Link.__new__(ucx._Link)
    other.endpoint, other._progress, other._pending = Endpoint(), Progress(Request(), 1), []
    other.abort()  # every settle prunes what has completed since
    gc.collect()
    assert not ucx._UNSETTLED and watcher() is None


class Posted:
    """A request of a fake endpoint: done at once, or never."""

    def __init__(self, done: bool) -> None:
        self.done = done

    async def wait(self) -> None:
        while not self.done:
            await asyncio.sleep(0.01)


class HandshakeEndpoint:
    """Answers a handshake as a peer would (its info in the receive buffer), or never."""

    def __init__(self, peer_tag: int | None) -> None:
        self.peer_tag = peer_tag

    def stream_send(self, array: Any) -> Posted:
        return Posted(True)

    def stream_recv(self, array: Any) -> Posted:
        if self.peer_tag is None:
            return Posted(False)
        from ucxx._lib_async.utils import hash64bits

        array.obj[:] = struct.pack("QQ", self.peer_tag, hash64bits(self.peer_tag))
        return Posted(True)


def test_a_handshake_that_ends_early_keeps_the_buffer_ucx_may_still_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """ucxx's handshake freed its receive buffer when its wait timed out, with the receive still
    posted: a late reply then landed in freed memory (workers died of SIGSEGV under load). The
    handshake pdserve installs keeps it; a completed one returns the peer's tag as ucxx's did."""
    from cluster.transfer import ucx

    ucx.init_ucx()
    from ucxx._lib_async import application_context, listener

    monkeypatch.setattr(ucx, "_ABANDONED_HANDSHAKES", [])
    exchange = application_context.exchange_peer_info
    assert listener.exchange_peer_info is exchange  # both ways of connecting use it
    for side in (False, True):
        assert asyncio.run(exchange(HandshakeEndpoint(77), 5, side))["msg_tag"] == 77
    with pytest.raises(TimeoutError):
        asyncio.run(exchange(HandshakeEndpoint(None), 5, False, connect_timeout=0.05))
    (kept,) = ucx._ABANDONED_HANDSHAKES
    assert any(isinstance(array.obj, bytearray) and len(array.obj) == 16 for array in kept)
