"""The service streams of one API request's `n` choices, merged into one stream of (choice index,
event) in arrival order: what both front doors relay.

One pump task per stream drains it into a shared queue, so a slow consumer of one choice never
stalls another, and cancelling the pumps (`aclose`) ends the service streams. The queue holds at
most `events_ahead` events: a client that reads slowly holds the pumps back, and with them the
streams behind (which merge what the engine makes meanwhile), instead of this process buffering a
whole answer it cannot send. An ending is always delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from cluster.common.events import TokenEvent


class MergedStreams:
    def __init__(self, streams: list[AsyncIterator[TokenEvent]], events_ahead: int) -> None:
        self.queue: asyncio.Queue[tuple[int, TokenEvent | Exception | None]] = asyncio.Queue()
        self.room = asyncio.Semaphore(events_ahead)
        self.num_streaming = len(streams)
        self.tasks = [asyncio.create_task(self._pump(index, stream)) for index, stream in enumerate(streams)]

    def __aiter__(self) -> MergedStreams:
        return self

    async def __anext__(self) -> tuple[int, TokenEvent]:
        """The next event of any stream; raises what a stream raised, StopAsyncIteration once all ended."""
        while self.num_streaming:
            index, item = await self.queue.get()
            if item is None:
                self.num_streaming -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                self.room.release()
                return index, item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _pump(self, index: int, stream: AsyncIterator[TokenEvent]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]  # services return async generators
                async for event in stream:
                    await self.room.acquire()
                    self.queue.put_nowait((index, event))
        except Exception as error:
            self.queue.put_nowait((index, error))
        finally:
            self.queue.put_nowait((index, None))
