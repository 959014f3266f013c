"""Many requests' streams over one Ray stream per (caller, actor) pair: a step's tokens in one message.

A Ray streaming call costs each side a fraction of a millisecond per item, whatever the item. One
stream per request would make a decode step of 64 requests 64 items at every hop (worker to router,
router to gateway), CPU the router and the gateway take from the cores the engines compute on
(docs/performance.md has the figures). Here a caller opens one `channel` per actor and starts each request
with a short `open` call; the actor runs the request's stream in a task and every item it yields
waits in the channel's outbox until the channel's next message, which carries all that waited. So
one message carries a whole step of every request the caller has on that actor.

What per-request Ray streams give, kept:
- a caller that stops reading a request early (its client left) cancels the actor's task (`close`);
- an actor that dies fails every request it held with `RayActorError`, as their streams did;
- an error raised by a request's stream on the actor is raised to that request's reader alone.
Backpressure is on the channel (`AHEAD` messages), not per request: a slow client's items wait in
its reader's queue, never holding back the other requests on the same channel; that queue holds at
most the request's tokens (`max_tokens`), and a reader that lags reads them joined into one event.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import pickle
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from cluster.common.events import TokenEvent, follows, joined

log = logging.getLogger(__name__)

AHEAD = 4  # channel messages an actor runs ahead of its reader before it waits (merging meanwhile)


@dataclass(frozen=True, slots=True)
class _End:
    """A request's stream ended: nothing follows."""


END = _End()


@dataclass(frozen=True, slots=True)
class _Failed:
    """A request's stream raised `error` on the actor."""

    error: BaseException


def _sendable(error: BaseException) -> BaseException:
    """The error itself when it crosses a process boundary (a call's error from another actor, Ray's
    RayTaskError, as the exception inside it); else a RuntimeError naming it (a message that does not
    pickle would end the whole channel)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    try:
        pickle.dumps(error)
    except Exception:  # any failure to pickle means the same: send its text
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


class Outbox:
    """An actor's side of one caller's channel: the items its requests yielded since the last message."""

    def __init__(self) -> None:
        self.waiting: list[tuple[str, Any]] = []
        self.ready = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def put(self, key: str, item: Any) -> None:
        self.waiting.append((key, item))
        self.ready.set()

    def start(self, key: str, items: AsyncIterator[Any]) -> None:
        self.tasks[key] = asyncio.get_running_loop().create_task(self._pump(key, items))

    async def _pump(self, key: str, items: AsyncIterator[Any]) -> None:
        try:
            async for item in items:
                self.put(key, item)
            self.put(key, END)
        except asyncio.CancelledError:  # its reader closed it: nobody waits for more
            raise
        except Exception as error:  # the stream's own failure, raised to its reader
            self.put(key, _Failed(_sendable(error)))
        finally:
            self.tasks.pop(key, None)

    def close(self, key: str) -> None:
        task = self.tasks.pop(key, None)
        if task is not None:
            task.cancel()

    async def messages(self) -> AsyncIterator[list[tuple[str, Any]]]:
        while True:
            await self.ready.wait()
            self.ready.clear()
            # Let the other requests' tasks readied by the same engine step add theirs first.
            await asyncio.sleep(0)
            message, self.waiting = self.waiting, []
            if message:
                yield message


class ChannelHost:
    """The actor's face of channels, mixed into an actor class. `streams` names the methods a caller
    may open (async generators of the actor); they run on the loop of the `open` call (the actor's
    default group). Its state lives in the instance's `__dict__`, made on first use, so the actor
    classes need not call an `__init__` of the mixin."""

    streams: frozenset[str] = frozenset()

    def _outbox(self, caller: str) -> Outbox:
        outboxes: dict[str, Outbox] = self.__dict__.setdefault("_outboxes", {})
        return outboxes.setdefault(caller, Outbox())

    def channel_totals(self) -> tuple[int, int]:
        """(messages, items) sent on all channels so far: items per message is the batching."""
        return self.__dict__.get("_channel_totals", (0, 0))

    async def channel(self, caller: str) -> AsyncIterator[list[tuple[str, Any]]]:
        """One caller's messages, for as long as it reads them."""
        outbox = self._outbox(caller)
        try:
            async for message in outbox.messages():
                messages, items = self.channel_totals()
                self.__dict__["_channel_totals"] = (messages + 1, items + len(message))
                yield message
        finally:  # the caller is gone (or reopened): its streams with it
            for key in list(outbox.tasks):
                outbox.close(key)
            self.__dict__.get("_outboxes", {}).pop(caller, None)

    async def open(self, caller: str, key: str, method: str, *args: Any) -> None:
        """Start the stream `method(*args)`; its items go out on the caller's channel under `key`."""
        if method not in self.streams:
            raise ValueError(f"{method!r} is not a stream of {type(self).__name__}")
        self._outbox(caller).start(key, getattr(self, method)(*args))

    async def close(self, caller: str, key: str) -> None:
        """The caller stopped reading the stream `key`: end it here."""
        self._outbox(caller).close(key)


class _Items:
    """One stream's items not read yet. A reader that lags reads a run of consecutive token events
    as one (`joined`): it relays one event, not each step's."""

    def __init__(self) -> None:
        self.items: collections.deque[Any] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> Any:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        run = [self.items.popleft()]
        while isinstance(run[-1], TokenEvent) and self.items and isinstance(self.items[0], TokenEvent) \
                and follows(self.items[0], run[-1]):
            run.append(self.items.popleft())
        return joined(run) if isinstance(run[0], TokenEvent) else run[0]


class Inbox:
    """A caller's side of its channel to one actor: reads the messages and hands each request its items."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.caller = uuid.uuid4().hex  # the actor's name for this channel
        self.loop = asyncio.get_running_loop()  # its reader's, and its queues'
        self.channel: Any = None  # the Ray stream, once opened
        self.queues: dict[str, _Items] = {}  # by stream key
        self.keys = itertools.count()
        self.error: BaseException | None = None
        self.reader: asyncio.Task[None] | None = None

    def _read(self) -> None:
        if self.reader is None:
            self.reader = asyncio.get_running_loop().create_task(self._read_channel())

    async def _read_channel(self) -> None:
        channel = self.handle.channel.options(num_returns="streaming", _generator_backpressure_num_objects=AHEAD)
        try:
            self.channel = channel.remote(self.caller)
            async for ref in self.channel:
                for key, item in await ref:
                    queue = self.queues.get(key)
                    if queue is not None:  # else: closed by its reader, the actor had more on the way
                        queue.put(item)
            raise ConnectionError("the actor ended the channel")
        except Exception as error:  # the actor died (RayActorError) or the channel broke
            self.error = error
            for queue in self.queues.values():
                queue.put(_Failed(error))

    async def stream(self, method: str, *args: Any) -> AsyncIterator[Any]:
        """The items of the actor's `method(*args)`, as a Ray stream of their own gave them."""
        key = f"{next(self.keys)}"  # never reused: a closed stream's late items find no queue
        queue = self.queues[key] = _Items()
        ended = False
        try:
            self._read()
            if self.error is not None:
                raise self.error
            await self.handle.open.remote(self.caller, key, method, *args)
            while True:
                item = await queue.get()
                if isinstance(item, _End):  # unpickled: a copy of END, not END
                    ended = True
                    return
                if isinstance(item, _Failed):
                    ended = True
                    raise item.error
                yield item
        finally:
            del self.queues[key]
            if not ended and self.error is None:
                with contextlib.suppress(Exception):  # a dead actor holds nothing to close
                    self.handle.close.remote(self.caller, key)


    def abandon(self) -> None:
        """End the channel on the actor's side too (its loop is gone: nothing reads it here any more)."""
        import ray

        if self.channel is not None and self.error is None:
            with contextlib.suppress(Exception):
                ray.cancel(self.channel)


class Inboxes:
    """A caller's channels, one per actor handle, made on first use and made again after a failure
    (Ray restarts a dead actor under the same handle: the new process gets a new channel) or from
    another event loop than the last (a channel's reader lives on one)."""

    def __init__(self) -> None:
        self.inboxes: dict[int, Inbox] = {}

    def of(self, handle: Any) -> Inbox:
        inbox = self.inboxes.get(id(handle))
        if inbox is not None and inbox.loop is not asyncio.get_running_loop():
            inbox.abandon()
            inbox = None
        if inbox is None or inbox.error is not None:
            inbox = self.inboxes[id(handle)] = Inbox(handle)
        return inbox

    def stream(self, handle: Any, method: str, *args: Any) -> AsyncIterator[Any]:
        return self.of(handle).stream(method, *args)
