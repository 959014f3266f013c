"""An async call made at most once per interval: its callers share one answer while it is fresh.

What a client can ask for as often as it likes, and what each answer costs the cluster (a Ray call
per worker behind every scrape of /metrics), are kept apart by this: N calls within `interval_s`
cost one call underneath, and calls that arrive while it runs wait for it instead of starting
their own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Throttled(Generic[T]):
    """`await throttled()`: the last answer of `call` if it is younger than `interval_s`, else a
    fresh one (one call at a time; concurrent callers await the same). A failed call is not kept:
    the next caller tries again."""

    def __init__(self, call: Callable[[], Awaitable[T]], interval_s: float) -> None:
        self._call, self._interval_s = call, interval_s
        self._answer: tuple[float, T] | None = None
        self._running: asyncio.Future[T] | None = None

    async def __call__(self) -> T:
        if self._answer is not None and time.monotonic() - self._answer[0] < self._interval_s:
            return self._answer[1]
        if self._running is None:
            self._running = asyncio.ensure_future(self._refresh())
        # Shielded: one caller going away (a scrape cut off) does not cancel the others' answer.
        return await asyncio.shield(self._running)

    async def _refresh(self) -> T:
        try:
            answer = await self._call()
            self._answer = (time.monotonic(), answer)
            return answer
        finally:
            self._running = None
