"""Work a front door must not do on its event loop: tokenizing, rendering chat templates, formatting
large answers. The loop also serves /health, every other stream, gRPC, Redis calls and Ray streams;
a 1 MiB prompt can take seconds to tokenize, and held there it would stall them all.

`OffLoop.run` runs such work in a small thread pool of the process and bounds how long a request may
wait for it (queued behind others included): past `timeout_s` the request is refused as the server
being busy (503 / UNAVAILABLE), though the thread finishes its piece (a thread cannot be stopped).
The tokenizers' Rust code lets other threads run while it works, so the loop stays responsive.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cluster.common.errors import ServiceUnavailable

T = TypeVar("T")
DEFAULT_THREADS = 4
DEFAULT_TIMEOUT_S = 30.0


class OffLoop:
    def __init__(self, threads: int = DEFAULT_THREADS, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="off-loop")

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` in the pool; ServiceUnavailable if it is not done within `timeout_s`."""
        work = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(function, *args))
        try:
            return await asyncio.wait_for(work, self.timeout_s)
        except TimeoutError:
            raise ServiceUnavailable(f"preparing the request took over {self.timeout_s:.0f} s: the server is busy; "
                                     "retry later") from None

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
