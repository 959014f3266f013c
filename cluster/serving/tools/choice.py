"""A request's `tool_choice`: how its output is held to tool calls, and how calls are read back.

| tool_choice        | the output                                                  | read by                   |
|--------------------|-------------------------------------------------------------|---------------------------|
| `none`             | free text; the tools are still in the prompt (vLLM's default) | nothing: it is content  |
| `auto` (default)   | free text, calls in the model's own format                  | the server's parser       |
| `required`         | a JSON array of `{"name", "parameters"}`, by a JSON schema | `JsonArray`              |
| a named function   | that function's arguments object, by its `parameters` schema | `NamedCall`             |

The schemas follow vLLM's, so a model held to them writes what vLLM's would.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cluster.common.structured_output import StructuredOutput
from cluster.serving.tools.parsers import CallFormat, JsonArray
from cluster.serving.tools.stream import CallStream, NamedCall, ParsedCalls

# A function without `parameters` takes none: its arguments are an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`tools`: each offered function's name and `parameters` schema (None: it takes none).
    `name`: the function a named choice calls. `parallel`: whether one answer may hold several calls."""

    mode: ToolMode
    tools: Mapping[str, dict[str, Any] | None]
    name: str = ""
    parallel: bool = True

    def structured_output(self) -> StructuredOutput | None:
        """The constraint that makes the output calls, for `required` and a named function."""
        if self.mode == "named":
            return StructuredOutput("json", json.dumps(self.tools[self.name] or NO_PARAMETERS))
        if self.mode == "required":
            return StructuredOutput("json", json.dumps(required_schema(self.tools, self.parallel)))
        return None

    def call_stream(self, parser: CallFormat) -> CallStream | None:
        """What reads one choice's calls out of its text (None: the text is all content)."""
        max_calls = None if self.parallel else 1
        if self.mode == "auto":
            return ParsedCalls(parser, self.tools.keys(), max_calls)
        if self.mode == "required":
            return ParsedCalls(JsonArray(), self.tools.keys(), max_calls)
        if self.mode == "named":
            return NamedCall(self.name)
        return None


def required_schema(tools: Mapping[str, dict[str, Any] | None], parallel: bool = True) -> dict[str, Any]:
    """A JSON array of one or more calls, each `{"name": <a tool>, "parameters": <its arguments>}`.

    A `$ref` in a tool's parameters points into the document's root (`#/$defs/...`); nested here,
    that root is this array's schema, so every tool's `$defs` move up to it."""
    definitions: dict[str, Any] = {}
    alternatives = []
    for name, parameters in tools.items():
        parameters = dict(parameters or NO_PARAMETERS)
        moved = parameters.pop("$defs", {})
        if not isinstance(moved, dict):
            raise ValueError(f"tools: the $defs of {name!r} must be an object")
        for key, definition in moved.items():
            if definitions.setdefault(key, definition) != definition:
                raise ValueError(f"tools define $defs/{key} in two different ways: rename one")
        alternatives.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                             "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters}})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema
