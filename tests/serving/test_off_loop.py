"""The front doors' thread pool (cluster.serving.off_loop): tenants take turns, so one with a queue
of large prompts holds another's request back by at most one piece per thread; a piece past the
time limit is refused and still holds its thread until it is done; nothing waits forever."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cluster.common.errors import ServiceUnavailable
from cluster.serving.off_loop import OffLoop


def test_a_tenant_with_a_queue_of_work_holds_another_back_by_one_piece_per_thread() -> None:
    started: list[str] = []

    def piece(name: str) -> str:
        started.append(name)
        time.sleep(0.02)
        return name

    async def main() -> list[str]:
        pool = OffLoop(threads=2)
        flood = [asyncio.create_task(pool.run(piece, f"a{index}", tenant="a")) for index in range(10)]
        await asyncio.sleep(0)  # the flood is queued first
        victim = asyncio.create_task(pool.run(piece, "b", tenant="b"))
        done = await asyncio.gather(*flood, victim)
        pool.close()
        assert pool._busy == 0 and not pool._waiting and not pool._running
        return done

    assert asyncio.run(main()) == [f"a{index}" for index in range(10)] + ["b"]
    assert started.index("b") <= 2  # after the two pieces already running, not after all ten


def test_a_piece_past_the_limit_is_refused_and_holds_its_thread_until_done() -> None:
    release = threading.Event()

    async def main() -> None:
        pool = OffLoop(threads=1, timeout_s=0.1)
        with pytest.raises(ServiceUnavailable):
            await pool.run(release.wait, 5)
        assert pool._busy == 1  # the thread still runs it: nobody else is given it
        waiting = asyncio.create_task(pool.run(lambda: "next", tenant="other"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        release.set()
        assert await waiting == "next"
        assert pool._busy == 0 and not pool._waiting and not pool._running
        pool.close()

    asyncio.run(main())


def test_a_caller_that_stops_waiting_in_the_queue_leaves_it() -> None:
    release = threading.Event()

    async def main() -> None:
        pool = OffLoop(threads=1)
        running = asyncio.create_task(pool.run(release.wait, 5))
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(pool.run(lambda: "never", tenant="gone"))
        await asyncio.sleep(0.01)
        queued.cancel()
        await asyncio.sleep(0.01)
        assert not pool._waiting
        release.set()
        assert await running is True
        assert await pool.run(lambda: "after") == "after" and pool._busy == 0
        pool.close()

    asyncio.run(main())
