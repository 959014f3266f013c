"""Each model family's tool call format, read whole: calls, the text around them, and what is not calls."""

from __future__ import annotations

import pytest

from cluster.serving.tools.calls import Reply, ToolCall, assemble
from cluster.serving.tools.parsers import PARSERS, CallFormat, JsonArray, detect_parser, json_end, parser_named
from cluster.serving.tools.stream import ParsedCalls, parse

TOOLS = ("get_weather", "get_time")
WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ToolCall("get_time", "{}")


def format_named(parser: str) -> CallFormat:
    return JsonArray() if parser == "required" else parser_named(parser)


def read(parser: str, text: str, tools: tuple[str, ...] = TOOLS) -> Reply:
    return parse(ParsedCalls(format_named(parser), tools), text)


def read_by_character(parser: str, text: str) -> Reply:
    stream = ParsedCalls(format_named(parser), TOOLS)
    return assemble([*(item for character in text for item in stream.feed(character)), *stream.finish()])


@pytest.mark.parametrize(("parser", "text", "expected"), [
    # one call
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     Reply(None, (WEATHER,))),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     Reply(None, (WEATHER,))),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
     Reply(None, (WEATHER,))),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', Reply(None, (WEATHER,))),
    # several calls, in order; whitespace between them is markup
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n', Reply(None, (WEATHER, TIME))),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {}}', Reply(None, (WEATHER, TIME))),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {}}]', Reply(None, (WEATHER, TIME))),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
     Reply(None, (WEATHER, TIME))),
    # text before the calls is content; the space before a call is not
    ("hermes", 'Let me look.\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     Reply("Let me look.", (TIME,))),
    ("mistral", 'Let me look. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', Reply("Let me look.", (TIME,))),
    # the special-token markers a decoder drops: calls that open the output bare
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}', Reply(None, (TIME,))),
    ("mistral", '  [{"name": "get_time", "arguments": {}}]', Reply(None, (TIME,))),
    # a call the model left open when it stopped, but whose JSON is whole
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', Reply(None, (TIME,))),
    # no arguments, or arguments written as a JSON string, are still an object
    ("hermes", '<tool_call>{"name": "get_time"}</tool_call>', Reply(None, (TIME,))),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', Reply(None, (TIME,))),
    # brackets and markers inside JSON strings are text
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "]}; {\\"x"}}',
     Reply(None, (ToolCall("get_weather", '{"city": "]}; {\\"x"}'),))),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "é <tool_call>"}}</tool_call>',
     Reply(None, (ToolCall("get_weather", '{"city": "é <tool_call>"}'),))),
])
def test_well_formed_calls_are_read(parser: str, text: str, expected: Reply) -> None:
    assert read(parser, text) == expected


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", "The weather in Paris is mild.  "),
    ("hermes", "<tool_call>not json</tool_call>"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),  # cut by max_tokens
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("hermes", "<tool_call>[]</tool_call>"),
    ("hermes", "<tool_ca"),
    ("llama3_json", 'It is {"name": "get_time", "parameters": {}}'),  # calls only open the output
    ("llama3_json", '{"name": "get_time", "parameters": {}'),
    ("llama3_json", '{"city": "Paris"}'),
    ("mistral", "[TOOL_CALLS] nothing"),
    ("mistral", "[TOOL_CALLS]get_time[ARGS]not json"),
    ("mistral", "[link](https://example.com) and more"),
    ("mistral", 'It is [{"name": "get_time", "arguments": {}}]'),  # bare calls only open the output
    ("required", 'It is [{"name": "get_time", "parameters": {}}]'),
])
def test_what_is_not_calls_is_content_as_written(parser: str, text: str) -> None:
    assert read(parser, text) == read_by_character(parser, text) == Reply(text, ())


def test_the_required_array_is_read_once() -> None:
    text = '[{"name": "get_time", "parameters": {}}] [{"name": "get_time", "parameters": {}}]'
    assert read("required", text) == read_by_character("required", text) == Reply(text[text.index("] ") + 2:],
                                                                                  (TIME,))


def test_a_mistral_marker_before_something_that_is_no_name_is_text() -> None:
    text = "[TOOL_CALLS]no name here [TOOL_CALLS]get_time[ARGS]{}"
    assert read("mistral", text) == read_by_character("mistral", text) == Reply("[TOOL_CALLS]no name here", (TIME,))


def test_a_call_of_a_tool_not_offered_is_content() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert read("hermes", text) == Reply(text, ())
    assert read("hermes", text, tools=("rm_rf",)) == Reply(None, (ToolCall("rm_rf", "{}"),))


def test_a_malformed_block_among_calls_stays_content_and_the_calls_stay_calls() -> None:
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{oops}</tool_call>'
            '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert read("hermes", text) == Reply("<tool_call>{oops}</tool_call>", (TIME, TIME))


def test_at_most_max_calls_are_kept() -> None:
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]'
    stream = ParsedCalls(parser_named("mistral"), TOOLS, max_calls=1)
    assert parse(stream, text) == Reply(None, (TIME,))


def test_arguments_keep_non_ascii_text() -> None:
    reply = read("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>')
    assert reply.calls[0].arguments == '{"city": "Zürich"}'


@pytest.mark.parametrize(("template", "parser"), [
    ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>", "hermes"),
    ("[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS] ... [TOOL_CALLS]", "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("{% for message in messages %}{{ message['content'] }}{% endfor %}", "hermes"),  # none shown: the default
    (None, "hermes"),
])
def test_the_parser_follows_the_format_the_chat_template_shows(template: str | None, parser: str) -> None:
    assert detect_parser(template) == parser


def test_an_unknown_parser_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        parser_named("xml")
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral"]


@pytest.mark.parametrize(("text", "end"), [
    ('{"a": [1, {"b": "}"}]} tail', 22), ('[1, "\\"]"]x', 10), ('{"a": "open', None), ("{[}", None), ("[]", 2),
])
def test_json_end_counts_brackets_outside_strings(text: str, end: int | None) -> None:
    assert json_end(text, 0) == end
