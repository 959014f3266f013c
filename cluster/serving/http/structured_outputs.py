"""The HTTP API's structured-output fields, on completions and chat completions alike, and the one
`StructuredOutput` they ask for.

- OpenAI's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}. The schema is enforced whatever `strict` says.
- vLLM's older fields: `guided_json` (a schema, as an object or as JSON text), `guided_regex`,
  `guided_choice` (a list of strings), `guided_grammar` (Lark or GBNF).
- vLLM's newer `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}.
At most one may ask for a form (400 otherwise); whether it compiles the service checks (400 too).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.common.structured_output import StructuredOutput


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` is a name pydantic's BaseModel already has.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatParam(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParam(BaseModel):
    """vLLM's `structured_outputs`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # `json` too is BaseModel's
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None  # refused: not implemented


class StructuredOutputFields(BaseModel):
    """The fields, for `SamplingRequest` to inherit, and the form they ask for."""

    response_format: ResponseFormatParam | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParam | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one form these fields ask for, None for free text; ValueError when several ask for one,
        or one is malformed."""
        asked = {name: form for name, form in self._forms() if form is not None}
        if len(asked) > 1:
            raise ValueError(f"only one structured output may be asked for, got {', '.join(sorted(asked))}")
        return next(iter(asked.values()), None)

    def _forms(self) -> list[tuple[str, StructuredOutput | None]]:
        forms = [("response_format", _of_response_format(self.response_format)),
                 ("guided_json", _json_form(self.guided_json)),
                 ("guided_regex", _form("regex", self.guided_regex)),
                 ("guided_choice", _choice_form(self.guided_choice)),
                 ("guided_grammar", _form("grammar", self.guided_grammar))]
        if self.structured_outputs is not None:
            nested = _of_structured_outputs(self.structured_outputs)
            forms += [(f"structured_outputs.{name}", form) for name, form in nested]
        return forms


def _form(kind: str, spec: str | None) -> StructuredOutput | None:
    return None if spec is None else StructuredOutput(kind, spec)


def _json_form(schema: dict[str, Any] | str | None) -> StructuredOutput | None:
    if schema is None:
        return None
    return StructuredOutput("json", schema if isinstance(schema, str) else json.dumps(schema))


def _choice_form(choices: list[str] | None) -> StructuredOutput | None:
    return None if choices is None else StructuredOutput.of_choices(choices)


def _of_response_format(response_format: ResponseFormatParam | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    if response_format.json_schema is None:
        raise ValueError('response_format of type "json_schema" needs its json_schema: {"name": ..., "schema": ...}')
    schema = response_format.json_schema.json_schema
    return StructuredOutput("json_object") if schema is None else _json_form(schema)


def _of_structured_outputs(param: StructuredOutputsParam) -> list[tuple[str, StructuredOutput | None]]:
    if param.structural_tag is not None:
        raise ValueError("structured_outputs.structural_tag is not supported by this server")
    return [("json", _json_form(param.json_schema)), ("regex", _form("regex", param.regex)),
            ("choice", _choice_form(param.choice)), ("grammar", _form("grammar", param.grammar)),
            ("json_object", StructuredOutput("json_object") if param.json_object else None)]
