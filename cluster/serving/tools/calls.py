"""The vocabulary of tool calls read from a model's output: whole calls, and the pieces a stream sends."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text: what OpenAI's `function.arguments` carries


@dataclass(frozen=True, slots=True)
class CallDelta:
    """A piece of call `index` (counted per choice): its first piece names the function, the
    following ones extend its arguments. Concatenated, the pieces are the call."""

    index: int
    arguments: str
    name: str | None = None


# What a stream of model text turns into, in order: content text, or a piece of a call.
Item = str | CallDelta


@dataclass(frozen=True, slots=True)
class Reply:
    """A choice's whole answer: its text (None when there is none beside the calls) and its calls."""

    content: str | None
    calls: tuple[ToolCall, ...]


def assemble(items: Iterable[Item]) -> Reply:
    """The reply that `items`, as a stream sent them, add up to (what a client reassembles)."""
    content: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for item in items:
        if isinstance(item, str):
            content.append(item)
        elif item.name is not None:
            names.append(item.name)
            arguments.append([item.arguments])
        else:
            arguments[item.index].append(item.arguments)
    calls = tuple(ToolCall(name, "".join(parts)) for name, parts in zip(names, arguments, strict=True))
    text = "".join(content)
    return Reply(text if text or not calls else None, calls)


def new_call_id() -> str:
    """A call's id, as OpenAI's look ("call_" and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"
