"""How models write tool calls into their text, one format per model family, chosen by name.

A format only finds blocks: given the text not yet settled, `scan` says how much of it is surely
content and, once a block is whole, where it ends and which calls it holds. The incremental state
(what was sent, whitespace held back) lives in `cluster.serving.tools.stream`, which calls `scan`
again with more text each time; so a format is stateless and reads the same text the same way
however it was cut into pieces. A block is decided only when whole: a call is never sent and then
found malformed, and a block that does not parse is content, as the model wrote it.

| name          | what the model writes                                                            |
|---------------|----------------------------------------------------------------------------------|
| `hermes`      | text, then `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated (Hermes, Qwen) |
| `llama3_json` | `{"name": ..., "parameters": {...}}`, several joined by `;`, from the start       |
| `mistral`     | text, then `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` |

The engine decodes without special tokens, so a marker that is a special token in the model's
vocabulary (`<|python_tag|>`, Mistral's `[TOOL_CALLS]`) never shows: `llama3_json` and `mistral` also
read calls that open the output bare.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.serving.tools.calls import ToolCall

DEFAULT_PARSER = "hermes"


class Place(enum.Enum):
    """Where the unsettled text starts, which some formats need to know."""

    START = "start"  # the output's start: nothing but whitespace before
    AFTER_CALL = "after_call"  # right after a call (whitespace aside)
    CONTENT = "content"  # after text that is not a call


@dataclass(frozen=True, slots=True)
class Scan:
    """`text[:start]` is content. With `end`, `text[start:end]` is a whole block holding `calls`
    (None: it looked like calls but is not: it is content too). Without, the rest waits for more text."""

    start: int
    end: int | None = None
    calls: list[ToolCall] | None = None


class CallFormat(Protocol):
    def scan(self, text: str, place: Place, final: bool) -> Scan:
        """`final`: no more text will come, so an open block is decided now (`end` is set, or
        `start == len(text)`)."""
        ...


class Hermes:
    open, close = "<tool_call>", "</tool_call>"

    def scan(self, text: str, place: Place, final: bool) -> Scan:
        begin = text.find(self.open)
        if begin < 0:
            return Scan(len(text) if final else held_end(text, self.open))
        close = text.find(self.close, begin)
        if close < 0 and not final:
            return Scan(begin)
        # Unclosed at the end: the model may stop right after the JSON (its stop token, max_tokens).
        body_end, end = (len(text), len(text)) if close < 0 else (close, close + len(self.close))
        return Scan(begin, end, calls_of_json(text[begin + len(self.open):body_end]))


class Llama3Json:
    tag = "<|python_tag|>"

    def scan(self, text: str, place: Place, final: bool) -> Scan:
        if place is Place.CONTENT:  # calls only open the output, or follow a call
            return Scan(len(text))
        begin = _skip_space(text, 0)
        lead = ";" if place is Place.AFTER_CALL else self.tag
        after = begin
        if text.startswith(lead, begin):
            after += len(lead)
        elif lead.startswith(text[begin:]) and not final:
            return Scan(begin)  # the lead may still come
        elif place is Place.AFTER_CALL:
            return Scan(len(text))  # the separator is required between calls
        return _json_block(text, begin, _skip_space(text, after), "{", final, calls_of_json) or Scan(len(text))


class Mistral:
    marker, arguments = "[TOOL_CALLS]", "[ARGS]"

    def scan(self, text: str, place: Place, final: bool) -> Scan:
        at = _skip_space(text, 0)
        if place is Place.START and text.startswith("[", at) and not text.startswith(self.marker, at):
            # Calls that open the output bare (the marker decoded away). A part of the marker waits
            # here too: it is an unclosed bracket.
            return _json_block(text, at, at, "[", final, calls_of_json) or Scan(len(text))
        begin = text.find(self.marker)
        if begin < 0:
            return Scan(len(text) if final else held_end(text, self.marker))
        at = _skip_space(text, begin + len(self.marker))
        if text.startswith(("[", "{"), at):
            return _json_block(text, begin, at, text[at], final, calls_of_json) or Scan(len(text))
        return self._named_call(text, begin, at, final)

    def _named_call(self, text: str, begin: int, at: int, final: bool) -> Scan:
        """`name[ARGS]{...}` (Mistral's tokenizers from v11 on)."""
        not_calls = Scan(begin, begin + len(self.marker))  # the marker is text; what follows is read again
        split = text.find(self.arguments, at)
        if split < 0:
            return not_calls if final else Scan(begin)
        name = text[at:split].strip()
        if not _FUNCTION_NAME.fullmatch(name):
            return not_calls

        def read(arguments: str) -> list[ToolCall] | None:
            call = _call_of({"name": name, "arguments": _loads(arguments)})
            return None if call is None else [call]

        at = _skip_space(text, split + len(self.arguments))
        return _json_block(text, begin, at, "{", final, read) or not_calls


class JsonArray:
    """What `tool_choice: required` makes the model write (its grammar sees to it): a JSON array of
    `{"name": ..., "parameters": {...}}`, and nothing else."""

    def scan(self, text: str, place: Place, final: bool) -> Scan:
        if place is not Place.START:
            return Scan(len(text))
        return _json_block(text, 0, _skip_space(text, 0), "[", final, calls_of_json) or Scan(len(text))


PARSERS: dict[str, CallFormat] = {"hermes": Hermes(), "llama3_json": Llama3Json(), "mistral": Mistral()}
# What a chat template writes when it shows the model a call: the format it was trained on.
_TEMPLATE_MARKERS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"))


def parser_named(name: str) -> CallFormat:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: choose one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


def detect_parser(chat_template: str | None) -> str:
    """The parser for the format a chat template shows its model (`DEFAULT_PARSER` if it shows none)."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return DEFAULT_PARSER


# ---- reading calls ---------------------------------------------------------------------------------

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# A complete JSON string, a bracket, or a quote that opens a string not yet closed.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]|"', re.DOTALL)


def calls_of_json(text: str) -> list[ToolCall] | None:
    """The calls in `text`: one `{"name", "arguments" (or "parameters")}` object, or a list of them;
    None unless all of it is calls."""
    value = _loads(text)
    objects = value if isinstance(value, list) else [value]
    calls = [_call_of(item) for item in objects]
    if not calls or None in calls:
        return None
    return [call for call in calls if call is not None]


def _call_of(value: Any) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_block(text: str, begin: int, at: int, opener: str, final: bool,
                read: Callable[[str], list[ToolCall] | None]) -> Scan | None:
    """A block from `begin` whose JSON value opens with `opener` at `at`, whole once the value closes;
    None if something else is there."""
    if at == len(text):
        return Scan(len(text)) if final else Scan(begin)
    if text[at] != opener:
        return None
    end = json_end(text, at)
    if end is None:
        return Scan(begin, len(text), read(text[at:])) if final else Scan(begin)
    return Scan(begin, end, read(text[at:end]))


def json_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at `text[start]` closes (the index after it); None while
    it is open. Brackets inside strings do not count; the value need not be valid JSON."""
    depth = 0
    for match in _JSON_TOKENS.finditer(text, start):
        token = match.group()
        if token == '"':
            return None  # a string still open
        if token in ("{", "["):
            depth += 1
        elif token in ("}", "]"):
            depth -= 1
            if depth == 0:
                return match.end()
    return None


def held_end(text: str, marker: str) -> int:
    """Where `text` is surely content: before a tail that could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return len(text)


def _skip_space(text: str, start: int) -> int:
    return len(text) - len(text[start:].lstrip())
