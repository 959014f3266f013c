"""What an aborted UCX endpoint leaves behind: a request UCX did not finish within the flush keeps
its memory alive until it completes, so a late write never lands in memory Python freed and reused.
(With fakes for the request and the progress: the real race needs a machine slow enough to lose it.)"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

import pytest

from tests.transfer.conftest import HAS_UCXX

pytestmark = pytest.mark.skipif(not HAS_UCXX, reason="ucxx is not installed (pip install ucxx-cu12)")


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
    link._pending = (request, buffer)
    watcher = weakref.ref(buffer)
    del buffer
    link.abort()
    link._pending = None  # as the coroutine that awaited it is gone
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
    other.endpoint, other._progress, other._pending = Endpoint(), Progress(Request(), 1), None
    other.abort()  # every settle prunes what has completed since
    gc.collect()
    assert not ucx._UNSETTLED and watcher() is None
