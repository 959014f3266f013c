"""Work a front door must not do on its event loop: tokenizing, rendering chat templates, compiling
grammars, formatting large answers. The loop also serves /health, every other stream, gRPC, Redis
calls and Ray streams; a 1 MiB prompt can take seconds to tokenize, and held there it would stall
them all.

`OffLoop.run` runs such work in a small thread pool of the process and bounds how long a request may
wait for it (queued behind others included): past `timeout_s` the request is refused as the server
being busy (503 / UNAVAILABLE), though the thread finishes its piece (a thread cannot be stopped).
The tokenizers' Rust code lets other threads run while it works, so the loop stays responsive.

The pool is shared fairly by tenants (an API key's, else a client address): each has its own queue,
and a free thread takes the oldest piece of the waiting tenant with the fewest pieces running (in
turn among equals). A tenant that sends many large prompts at once waits behind its own; another
tenant's request waits for the first thread to come free, not for the whole queue.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cluster.common.errors import ServiceUnavailable

T = TypeVar("T")
DEFAULT_THREADS = 4
DEFAULT_TIMEOUT_S = 30.0


class OffLoop:
    """Used from one event loop (both doors of a process share it)."""

    def __init__(self, threads: int = DEFAULT_THREADS, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.threads, self.timeout_s = threads, timeout_s
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="off-loop")
        self._busy = 0  # threads given a piece
        self._running: collections.Counter[str] = collections.Counter()  # tenant -> its pieces holding threads
        # Tenant -> its waiting pieces, oldest first; the dict's order is the turn (a served tenant goes last).
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    async def run(self, function: Callable[..., T], *args: Any, tenant: str = "") -> T:
        """`function(*args)` in the pool, in `tenant`'s turn; ServiceUnavailable if it is not done
        within `timeout_s` of the call."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._turn(tenant)
                work = self._executor.submit(functools.partial(function, *args))
                # The thread is free when its piece is done, even if its caller stopped waiting for it.
                loop = asyncio.get_running_loop()
                work.add_done_callback(lambda _: _call_soon(loop, lambda: self._release(tenant)))
                return await asyncio.wrap_future(work)
        except TimeoutError:
            raise ServiceUnavailable(f"preparing the request took over {self.timeout_s:.0f} s: the server is busy; "
                                     "retry later") from None

    async def _turn(self, tenant: str) -> None:
        """Return once this piece holds a thread."""
        if self._busy < self.threads and not self._waiting:
            self._take(tenant)
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # given a thread as it was cancelled: pass it on
                self._release(tenant)
            elif tenant in self._waiting and turn in self._waiting[tenant]:
                self._waiting[tenant].remove(turn)
                if not self._waiting[tenant]:
                    del self._waiting[tenant]
            raise

    def _take(self, tenant: str) -> None:
        self._busy += 1
        self._running[tenant] += 1

    def _release(self, tenant: str) -> None:
        """`tenant`'s piece freed its thread: give it to the oldest piece of the waiting tenant with
        the fewest running."""
        self._busy -= 1
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        while self._busy < self.threads and self._waiting:
            tenant = min(self._waiting, key=lambda waiting: self._running[waiting])  # the first of equals
            queue = self._waiting.pop(tenant)
            turn = queue.popleft()
            if queue:
                self._waiting[tenant] = queue  # its next piece goes after every other tenant's
            if not turn.done():
                self._take(tenant)
                turn.set_result(None)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    if not loop.is_closed():  # a piece ending after the server stopped
        loop.call_soon_threadsafe(callback)
