"""Reading tool calls out of a choice's text as it streams, piece by piece.

A `CallStream` is fed each new piece of text and answers what can be sent now: content, or pieces
of calls (`CallDelta`). A whole answer is read by the same code in one piece (`parse`), so a
streamed answer reassembles to exactly the non-streamed one, however the text was cut.

Whitespace next to a call is markup, not content: the stream holds whitespace back until text
follows it, and drops what borders a call. An answer without calls comes back exactly as written.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from cluster.serving.tools.calls import CallDelta, Item, Reply, ToolCall, assemble
from cluster.serving.tools.parsers import CallFormat, Place


class CallStream(Protocol):
    def feed(self, text: str) -> list[Item]:
        """What the text so far, `text` being its newest piece, lets the stream send now."""
        ...

    def finish(self) -> list[Item]:
        """The rest, once the text is complete."""
        ...


class ParsedCalls:
    """Calls the model wrote in `format` among its text, at most `max_calls` (None: any number).
    A call naming a tool the request did not offer is not a call: it stays content."""

    def __init__(self, format: CallFormat, tools: Collection[str], max_calls: int | None = None) -> None:
        self.format, self.tools, self.max_calls = format, tools, max_calls
        self.pending = ""  # text not settled: it may still begin a call
        self.space = ""  # settled whitespace not sent: it goes with the next content, or nowhere
        self.place = Place.START
        self.num_calls = 0

    def feed(self, text: str) -> list[Item]:
        return self._read(text, final=False)

    def finish(self) -> list[Item]:
        items = self._read("", final=True)
        if self.space and not self.num_calls:
            items.append(self.space)  # without calls, the text comes back whole
        self.space = ""
        return items

    def _read(self, text: str, final: bool) -> list[Item]:
        self.pending += text
        items: list[Item] = []
        while True:
            scan = self.format.scan(self.pending, self.place, final)
            self._settle(self.pending[:scan.start], items)
            if scan.end is None:
                self.pending = self.pending[scan.start:]
                return items
            block, self.pending = self.pending[scan.start:scan.end], self.pending[scan.end:]
            if scan.calls is not None and all(call.name in self.tools for call in scan.calls):
                self._add_calls(scan.calls, items)
            else:
                self._settle(block, items)

    def _settle(self, text: str, items: list[Item]) -> None:
        """`text` is content: send it, but for whitespace that may yet border a call."""
        text = self.space + text
        if self.place is Place.AFTER_CALL:
            text = text.lstrip()
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            items.append(body)
            self.place = Place.CONTENT

    def _add_calls(self, calls: list[ToolCall], items: list[Item]) -> None:
        # The whitespace held before a call (`space`) is never sent: content after a call starts at
        # its first character that is not whitespace, and finish() sends none once there are calls.
        for call in calls:
            if self.max_calls is not None and self.num_calls >= self.max_calls:
                break  # parallel_tool_calls=false: the first call only
            items.append(CallDelta(self.num_calls, call.arguments, call.name))
            self.num_calls += 1
        self.place = Place.AFTER_CALL


class NamedCall:
    """The whole output is the arguments of function `name` (a grammar holds the model to them): the
    call opens at once, and each piece of text extends its arguments as it comes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.opened = False

    def feed(self, text: str) -> list[Item]:
        items: list[Item] = [] if self.opened else [CallDelta(0, "", self.name)]
        self.opened = True
        return [*items, CallDelta(0, text)] if text else items

    def finish(self) -> list[Item]:
        return self.feed("")


def parse(stream: CallStream, text: str) -> Reply:
    """A whole answer's content and calls, read by `stream` in one piece."""
    return assemble([*stream.feed(text), *stream.finish()])
