"""One request's outputs on their way from the engine thread to whoever streams them.

A queue that merges: an output put while the previous one still waits is folded into it (tokens,
text and logprobs appended). So a consumer that falls behind (a client that reads slowly, a Ray
stream held back by its backpressure) costs one pending output, however many steps the engine
runs meanwhile, and catches up with all of them at its next read. Errors are never merged.
"""

from __future__ import annotations

import asyncio
import collections

from cluster.engine.llm_engine import RequestOutput


class OutputStream:
    """Outputs of one request, put by the event loop (`put`), read by one consumer (`get`)."""

    def __init__(self) -> None:
        self._items: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: RequestOutput | BaseException) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            self._items[-1] = merged(last, item)
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
        return self._items.popleft()


def merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of a request as one: the news of both, the state of the later."""
    return RequestOutput(then.request_id, first.new_token_ids + then.new_token_ids, first.new_text + then.new_text,
                         then.token_ids, first.index, then.text, then.finished, then.finish_reason,
                         then.num_prompt_tokens, then.num_cached_tokens, first.new_logprobs + then.new_logprobs,
                         then.stop_reason, first.arrival_time,
                         first.first_token_time if first.first_token_time is not None else then.first_token_time)
