"""Calls read from a stream, however its text was cut, are the calls read from the whole text."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.serving.tools.calls import CallDelta, Reply, ToolCall, assemble
from cluster.serving.tools.parsers import JsonArray, parser_named
from cluster.serving.tools.stream import CallStream, NamedCall, ParsedCalls, parse

TOOLS = ("get_weather", "get_time")
FORMATS = ("hermes", "llama3_json", "mistral")
READERS = {**{name: parser_named(name) for name in FORMATS}, "required": JsonArray()}

# JSON values whose text holds what a scanner could trip on: brackets, quotes, escapes, markers.
tricky_text = st.lists(st.sampled_from([*'ab é"\\{}[];<>\n', "<tool_call>", "[TOOL_CALLS]", "[ARGS]"]),
                       max_size=8).map("".join)
values = st.recursive(st.none() | st.booleans() | st.integers() | tricky_text,
                      lambda inner: st.lists(inner, max_size=2) | st.dictionaries(tricky_text, inner, max_size=2),
                      max_leaves=5)
arguments = st.dictionaries(tricky_text, values, max_size=3)
calls = st.tuples(st.sampled_from(TOOLS), arguments)
space = st.text(" \n", max_size=2)
# Text around calls that cannot spell a marker.
prose = st.text(st.sampled_from("ab é.,!\n"), max_size=12)


@st.composite
def dumps(draw: st.DrawFn, value: Any) -> str:
    """`value` as a model might write it: with or without escapes and indentation."""
    return json.dumps(value, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1])))


@st.composite
def written_calls(draw: st.DrawFn, format: str) -> tuple[str, Reply]:
    """A model's answer in `format`: maybe text, then one to three calls; and what it must read as."""
    drawn = draw(st.lists(calls, min_size=1, max_size=3))
    expected = tuple(ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in drawn)
    before = "" if format == "llama3_json" else draw(prose)
    if format == "hermes":
        body = "".join(f"<tool_call>{draw(space)}{draw(dumps({'name': name, 'arguments': args}))}{draw(space)}"
                       f"</tool_call>{draw(space)}" for name, args in drawn)
    elif format == "llama3_json":
        tag = draw(st.sampled_from(["", "<|python_tag|>"]))
        body = tag + ";".join(draw(space) + draw(dumps({"name": name, "parameters": args})) for name, args in drawn)
    elif draw(st.booleans()):
        body = "[TOOL_CALLS]" + draw(dumps([{"name": name, "arguments": args} for name, args in drawn]))
    else:
        body = "".join(f"[TOOL_CALLS]{name}[ARGS]{draw(dumps(args))}" for name, args in drawn)
    return before + draw(space) + body + draw(space), Reply(before.rstrip() or None, expected)


# Pieces of markup and JSON, in any order: mostly not calls, sometimes calls, sometimes almost.
noise = st.lists(st.sampled_from([
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL", "[ARGS]", "<|python_tag|>", "{", "}", "[", "]",
    '"', "\\", ";", ":", ",", " ", "\n", "hi", '"name"', '"get_time"', "get_time", '"arguments"', '"parameters"',
    "{}", '{"name": "get_time", "arguments": {}}', '{"name": "get_time", "parameters": {}}',
]), max_size=14).map("".join)


def cuts(text: str) -> st.SearchStrategy[list[str]]:
    """`text` cut into pieces at any places (empty pieces included)."""
    points = st.lists(st.integers(0, len(text)), max_size=8).map(sorted)
    return points.map(lambda at: [text[i:j] for i, j in zip([0, *at], [*at, len(text)], strict=True)])


def streamed(stream: CallStream, pieces: list[str]) -> Reply:
    items = [item for piece in pieces for item in stream.feed(piece)]
    return assemble([*items, *stream.finish()])


def call_stream(format: str) -> ParsedCalls:
    return ParsedCalls(READERS[format], TOOLS)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), format=st.sampled_from(FORMATS))
def test_written_calls_are_read_back_whole_and_streamed_in_any_pieces(data: st.DataObject, format: str) -> None:
    text, expected = data.draw(written_calls(format))
    assert parse(call_stream(format), text) == expected
    assert streamed(call_stream(format), data.draw(cuts(text))) == expected


@settings(max_examples=500, deadline=None)
@given(data=st.data(), format=st.sampled_from(sorted(READERS)), text=noise | prose)
def test_any_text_streamed_in_any_pieces_reads_as_it_does_whole(data: st.DataObject, format: str, text: str) -> None:
    whole = parse(call_stream(format), text)
    assert streamed(call_stream(format), data.draw(cuts(text))) == whole
    if not whole.calls:
        assert whole.content == text  # nothing is lost, not even whitespace


@settings(max_examples=200, deadline=None)
@given(data=st.data(), drawn=st.lists(calls, min_size=1, max_size=3))
def test_the_required_array_streamed_in_any_pieces_is_its_calls(data: st.DataObject,
                                                                drawn: list[tuple[str, dict[str, Any]]]) -> None:
    text = data.draw(dumps([{"name": name, "parameters": args} for name, args in drawn]))
    expected = Reply(None, tuple(ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in drawn))
    assert streamed(ParsedCalls(JsonArray(), TOOLS), data.draw(cuts(text))) == expected


@settings(max_examples=100, deadline=None)
@given(data=st.data(), args=arguments)
def test_a_named_call_streams_its_arguments_as_they_come(data: st.DataObject, args: dict[str, Any]) -> None:
    text = data.draw(dumps(args))
    assert streamed(NamedCall("get_weather"), data.draw(cuts(text))) == Reply(None, (ToolCall("get_weather", text),))


def test_a_call_opens_with_its_name_then_its_arguments_follow() -> None:
    stream = NamedCall("get_time")
    assert stream.feed('{"tz"') == [CallDelta(0, "", "get_time"), CallDelta(0, '{"tz"')]
    assert stream.feed("") == []
    assert stream.feed(': "UTC"}') == [CallDelta(0, ': "UTC"}')]
    assert stream.finish() == []


def test_text_that_may_begin_a_call_is_held_back_until_it_is_known() -> None:
    stream = call_stream("hermes")
    assert stream.feed("Sure. <tool") == ["Sure."]  # the space may border a call: held too
    assert stream.feed("box> is") == [" <toolbox> is"]
    assert stream.feed(' <tool_call>{"name": "get_time", "arguments": {}}') == []
    assert stream.feed("</tool_call>\n") == [CallDelta(0, "{}", "get_time")]
    assert stream.finish() == []  # whitespace after the call is not content
