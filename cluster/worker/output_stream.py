"""One request's outputs on their way from the engine thread to whoever streams them.

A queue that merges: an output put while the previous one still waits is folded into it (tokens,
text and logprobs appended). So a consumer that falls behind (a client that reads slowly, a Ray
stream held back by its backpressure) costs one pending output, however many steps the engine
runs meanwhile, and catches up with all of them at its next read. Errors are never merged.
Merging appends to lists (the text's pieces too) and builds the merged output once, when it is
read: a long stall costs linear time, not quadratic.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from cluster.common.events import TokenLogprobs
from cluster.engine.llm_engine import RequestOutput


@dataclass(slots=True)
class _Merging:
    """Consecutive outputs not read yet: the first, the latest, and the news of all of them."""

    first: RequestOutput
    last: RequestOutput
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @classmethod
    def of(cls, output: RequestOutput) -> _Merging:
        return cls(output, output, list(output.new_token_ids), [output.new_text], list(output.new_logprobs))

    def add(self, output: RequestOutput) -> None:
        self.last = output
        self.token_ids += output.new_token_ids
        self.texts.append(output.new_text)
        self.logprobs += output.new_logprobs

    def output(self) -> RequestOutput:
        """The news of all, the state of the latest (prompt logprobs come with the first token only)."""
        first, last = self.first, self.last
        return RequestOutput(last.request_id, self.token_ids, "".join(self.texts), last.token_ids, first.index,
                             last.text, last.finished, last.finish_reason, last.num_prompt_tokens,
                             last.num_cached_tokens, self.logprobs, last.stop_reason, first.arrival_time,
                             first.first_token_time if first.first_token_time is not None else last.first_token_time,
                             first.prompt_logprobs)


class OutputStream:
    """Outputs of one request, put by the event loop (`put`), read by one consumer (`get`)."""

    def __init__(self) -> None:
        self._items: collections.deque[RequestOutput | _Merging | BaseException] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: RequestOutput | BaseException) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            last = self._items[-1] = _Merging.of(last)
        if isinstance(item, RequestOutput) and isinstance(last, _Merging) and not last.last.finished:
            last.add(item)
        else:
            self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        return item.output() if isinstance(item, _Merging) else item
