"""tool_choice as the JSON schema that holds the model to calls, and the calls read back from it."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from cluster.common.structured_output import StructuredOutput
from cluster.serving.tools.calls import Reply, ToolCall
from cluster.serving.tools.choice import ToolChoice, required_schema
from cluster.serving.tools.parsers import parser_named
from cluster.serving.tools.stream import NamedCall, ParsedCalls, parse

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"], "additionalProperties": False}
TOOLS: dict[str, dict[str, Any] | None] = {"get_weather": WEATHER, "get_time": None}
HERMES = parser_named("hermes")


def valid(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_a_named_function_holds_the_output_to_its_arguments() -> None:
    structured = ToolChoice("named", TOOLS, "get_weather").structured_output()
    assert structured == StructuredOutput("json", json.dumps(WEATHER))
    no_parameters = ToolChoice("named", TOOLS, "get_time").structured_output()
    assert no_parameters is not None and json.loads(no_parameters.spec) == {"type": "object", "properties": {}}


def test_required_admits_calls_of_the_offered_tools_with_their_arguments_only() -> None:
    structured = ToolChoice("required", TOOLS).structured_output()
    assert structured is not None and structured.kind == "json"
    schema = json.loads(structured.spec)
    assert valid(schema, [{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}])
    assert valid(schema, [{"name": "get_time", "parameters": {}},
                          {"name": "get_weather", "parameters": {"city": "Rome"}}])
    assert not valid(schema, [])  # at least one call
    assert not valid(schema, [{"name": "get_weather", "parameters": {"days": 2}}])  # its schema: city required
    assert not valid(schema, [{"name": "get_weather", "parameters": {"city": "Paris", "days": 0}}])
    assert not valid(schema, [{"name": "rm_rf", "parameters": {}}])
    assert not valid(schema, [{"name": "get_time", "parameters": {}, "comment": "extra"}])
    assert not valid(schema, {"name": "get_time", "parameters": {}})  # an array, not one call


def test_without_parallel_calls_required_admits_one_call() -> None:
    schema = required_schema(TOOLS, parallel=False)
    one, two = [{"name": "get_time", "parameters": {}}], [{"name": "get_time", "parameters": {}}] * 2
    assert valid(schema, one) and not valid(schema, two)
    assert valid(required_schema(TOOLS), two)


def test_definitions_move_to_the_root_where_their_references_point() -> None:
    place = {"$defs": {"Place": {"type": "string", "enum": ["Paris", "Rome"]}},
             "type": "object", "properties": {"city": {"$ref": "#/$defs/Place"}}, "required": ["city"]}
    schema = required_schema({"get_weather": place, "get_time": None})
    assert schema["$defs"] == place["$defs"] and "$defs" in place  # the request's schema is left as it was
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]  # moved, not copied
    assert valid(schema, [{"name": "get_weather", "parameters": {"city": "Rome"}}])
    assert not valid(schema, [{"name": "get_weather", "parameters": {"city": "Oslo"}}])


def test_two_tools_defining_one_name_differently_are_refused() -> None:
    first = {"$defs": {"Unit": {"enum": ["c"]}}, "type": "object"}
    second = {"$defs": {"Unit": {"enum": ["f"]}}, "type": "object"}
    with pytest.raises(ValueError, match="Unit"):
        required_schema({"a": first, "b": second})
    with pytest.raises(ValueError, match="must be an object"):
        required_schema({"a": {"$defs": [1]}})
    assert required_schema({"a": first, "b": first})["$defs"] == first["$defs"]  # the same twice is one


def test_auto_and_none_leave_the_output_free() -> None:
    assert ToolChoice("auto", TOOLS).structured_output() is None
    assert ToolChoice("none", TOOLS).structured_output() is None


def test_each_choice_reads_its_output_its_own_way() -> None:
    arguments = '{"city": "Paris"}'
    hermes = f'<tool_call>{{"name": "get_weather", "arguments": {arguments}}}</tool_call>'
    array = f'[{{"name": "get_weather", "parameters": {arguments}}}]'
    call = Reply(None, (ToolCall("get_weather", arguments),))
    assert ToolChoice("none", TOOLS).call_stream(HERMES) is None
    auto = ToolChoice("auto", TOOLS).call_stream(HERMES)
    assert isinstance(auto, ParsedCalls) and parse(auto, hermes) == call
    required = ToolChoice("required", TOOLS).call_stream(HERMES)
    assert required is not None and parse(required, array) == call
    named = ToolChoice("named", TOOLS, "get_weather").call_stream(HERMES)
    assert isinstance(named, NamedCall) and parse(named, arguments) == call


def test_without_parallel_calls_only_the_first_call_is_read() -> None:
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    serial = ToolChoice("required", TOOLS, parallel=False).call_stream(HERMES)
    assert serial is not None and parse(serial, text) == Reply(None, (ToolCall("get_time", "{}"),))
    hermes = '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_time"}</tool_call>'
    auto = ToolChoice("auto", TOOLS, parallel=False).call_stream(HERMES)
    assert auto is not None and len(parse(auto, hermes).calls) == 1
