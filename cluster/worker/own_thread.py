"""Work that runs torch ops before the engine thread starts, done on a thread that ends with it.

torch computes on OpenMP threads, and an OpenMP runtime keeps a team of threads for each thread
that ran a parallel op, for as long as that thread lives. libgomp (torch's OpenMP) counts every
team's threads, and once they outnumber the cores it stops spinning at its barriers: every op then
puts its threads to sleep and wakes them (a futex each), and every decode step slows down
(docs/performance.md has the figures). An actor's main thread and an executor's live for good: a
model loaded or warmed up there would keep a second team alive beside the engine thread's. Loading
and warming up on threads that end leaves the engine thread's team the only one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_own_thread(function: Callable[[], T], name: str = "pdserve-setup") -> T:
    """`function()` on a new thread, joined: the OpenMP team its torch ops started ends with it.
    Its result, or its exception raised here."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(function())
        except BaseException as error:  # handed to the caller's thread
            failure.append(error)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
