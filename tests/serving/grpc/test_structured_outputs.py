"""Structured outputs over gRPC: the `StructuredOutput` message through the SDK to the engine, and
INVALID_ARGUMENT for a form that does not compile. On the tiny random model, whose free text is
noise: an answer that follows its form is the grammar's doing."""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
import jsonschema
import pytest

from cluster.client import Client, ClientError
from cluster.common.structured_output import StructuredOutput
from cluster.grpc_stubs import pdserve_pb2 as pb
from cluster.serving.grpc.server import _params_of
from cluster.serving.local_service import LocalService
from tests.serving.grpc.conftest import pool_is_whole, wait_until

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "done": {"type": "boolean"}},
          "required": ["id", "done"], "additionalProperties": False}
SAMPLED = dict(temperature=1.0, max_tokens=150)


@pytest.mark.parametrize(("message", "expected"), [
    (pb.StructuredOutput(json_schema='{"type": "object"}'), StructuredOutput("json", '{"type": "object"}')),
    (pb.StructuredOutput(json_object=True), StructuredOutput("json_object")),
    (pb.StructuredOutput(regex="[0-9]+"), StructuredOutput("regex", "[0-9]+")),
    (pb.StructuredOutput(choice=pb.Choices(choices=["a", "b"])), StructuredOutput.of_choices(["a", "b"])),
    (pb.StructuredOutput(grammar='start: "a"'), StructuredOutput("grammar", 'start: "a"')),
])
def test_the_message_maps_to_the_structured_output(message: pb.StructuredOutput,
                                                   expected: StructuredOutput) -> None:
    assert _params_of(pb.SamplingParams(structured=message)).structured == expected
    assert _params_of(pb.SamplingParams()).structured is None


def test_sdk_forms_answer_as_asked(client: Client) -> None:
    answer = client.complete("Hello", structured={"json_schema": json.dumps(SCHEMA)}, **SAMPLED)
    jsonschema.validate(json.loads(answer.text), SCHEMA)
    assert answer.finish_reason == "stop"
    choices = ["north", "south", "east", "west"]
    for _ in range(3):
        assert client.complete("Hello", structured=StructuredOutput.of_choices(choices), **SAMPLED).text in choices
    streamed = "".join(chunk.text for chunk in client.generate("Hello", structured={"regex": "[A-Z][a-z]{2,8}!"},
                                                               **SAMPLED))
    assert re.fullmatch("[A-Z][a-z]{2,8}!", streamed), streamed


@pytest.mark.parametrize("structured", [
    {"json_schema": '{"type": "nonsense"}'}, {"json_schema": "{not json"}, {"regex": "(unclosed"},
    {"grammar": "start: missing_rule"}, {"choice": {"choices": []}}, {"json_object": False}, {},
])
def test_a_form_that_does_not_compile_is_invalid_argument(client: Client, service: LocalService,
                                                          structured: dict[str, Any]) -> None:
    with pytest.raises(ClientError) as caught:
        client.complete("Hello", structured=structured, max_tokens=4)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert wait_until(lambda: pool_is_whole(service))
