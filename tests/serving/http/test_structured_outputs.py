"""Structured outputs through the HTTP gateway: OpenAI's `response_format`, vLLM's `guided_*` and
`structured_outputs` fields, on completions and chat. The field mapping runs without a server; 400s
and answers that follow their schema on the tiny random model (whose free text is noise, so a
schema-valid answer is the grammar's doing); the default model through the official client (`slow`)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from cluster.common.structured_output import StructuredOutput
from cluster.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.serving.http.conftest import LiveGateway, engine_idle, wait_until
from tests.serving.http.test_http_gateway import CHAT, assert_error, sse_data

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.fixture
def client(tiny: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny.url, timeout=60) as client:
        yield client


# ---- request fields -> StructuredOutput ------------------------------------------------------------


def structured_of(body: dict[str, Any], chat: bool = True) -> StructuredOutput | None:
    request = ChatCompletionRequest.model_validate({"messages": CHAT, **body}) if chat else \
        CompletionRequest.model_validate({"prompt": "hi", **body})
    params = request.sampling_params(5, 100)
    assert len({p.structured for p in params}) == 1  # every choice gets the same
    return params[0].structured


@pytest.mark.parametrize(("body", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}}, StructuredOutput("json_object")),
    ({"guided_json": SCHEMA}, StructuredOutput("json", json.dumps(SCHEMA))),
    ({"guided_json": '{"type": "integer"}'}, StructuredOutput("json", '{"type": "integer"}')),
    ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutput.of_choices(["yes", "no"])),
    ({"guided_grammar": 'start: "a"+'}, StructuredOutput("grammar", 'start: "a"+')),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "a|b"}}, StructuredOutput("regex", "a|b")),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput.of_choices(["x"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    ({"structured_outputs": {"json_object": False}}, None),
])
def test_each_field_asks_for_its_form_on_both_endpoints(body: dict[str, Any],
                                                          expected: StructuredOutput | None) -> None:
    assert structured_of(body) == expected
    assert structured_of(body, chat=False) == expected


@pytest.mark.parametrize(("body", "message"), [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "only one structured output.*guided_choice, guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format, structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "grammar": 'start: "a"'}}, "only one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag is not supported"),
    ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
    ({"guided_choice": []}, "non-empty JSON list"),
])
def test_malformed_or_conflicting_fields_are_value_errors(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        structured_of(body)


# ---- the tiny model: 400s, and answers that follow their form --------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}),
    ("/v1/completions", {"guided_json": {"type": "array", "uniqueItems": True}}),  # not enforceable
    ("/v1/completions", {"guided_json": "{not json"}),
    ("/v1/completions", {"guided_regex": "(unclosed"}),
    ("/v1/completions", {"guided_grammar": "start: missing_rule"}),
    ("/v1/completions", {"guided_choice": []}),
    ("/v1/completions", {"guided_choice": "yes"}),
    ("/v1/chat/completions", {"guided_regex": "a", "structured_outputs": {"choice": ["a"]}}),
    ("/v1/chat/completions", {"structured_outputs": {"structural_tag": "{}"}}),
])
def test_invalid_or_conflicting_structured_outputs_get_400(client: httpx.Client, tiny: LiveGateway, path: str,
                                                            body: dict[str, Any]) -> None:
    prompt = {"messages": CHAT} if path.endswith("chat/completions") else {"prompt": "hi"}
    error = assert_error(client.post(path, json={**prompt, "max_tokens": 4, **body}), 400)
    assert error["type"] == "invalid_request_error"
    assert engine_idle(tiny.service)  # refused before anything was queued


def test_a_json_schema_answer_follows_its_schema(client: httpx.Client) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    response = client.post("/v1/chat/completions", json={"messages": CHAT, "response_format": response_format,
                                                           "temperature": 1.0, "max_tokens": 400, "n": 4})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_guided_fields_on_completions_and_a_stream(client: httpx.Client) -> None:
    choices = ["Paris", "Rome", "Berlin"]
    whole = client.post("/v1/completions", json={"prompt": "hi", "guided_choice": choices, "max_tokens": 20,
                                                 "temperature": 1.0, "n": 4}).json()
    assert all(choice["text"] in choices for choice in whole["choices"])
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "guided_regex": "[a-z]{3}-[0-9]{3}",
                                                        "max_tokens": 30, "temperature": 1.0,
                                                        "stream": True}) as response:
        chunks = sse_data(response)
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks[:-1] if chunk["choices"])
    assert re.fullmatch("[a-z]{3}-[0-9]{3}", text), text
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_the_first_request_of_a_schema_compiles_it_once(client: httpx.Client, tiny: LiveGateway) -> None:
    """The door compiles (to refuse a bad spec with a 400), the engine again from its own cache; a
    second request with the same schema is a hit in both."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    engine = tiny.service.engine
    for _ in range(2):
        response = client.post("/v1/completions", json={"prompt": "hi", "guided_json": schema, "max_tokens": 200})
        assert json.loads(response.json()["choices"][0]["text"])["n"] in range(10)
    assert wait_until(lambda: engine_idle(tiny.service))
    key = StructuredOutput("json", json.dumps(schema))
    assert key in engine.grammars._compiled and engine.grammars.hits >= 1


# ---- the default model, through the official client ------------------------------------------------


@pytest.mark.slow
def test_default_model_answers_a_json_schema_and_a_choice(default_gateway: LiveGateway) -> None:
    client = openai.OpenAI(base_url=f"{default_gateway.url}/v1", api_key="unused", max_retries=0)
    model = default_gateway.service.model_name
    response = client.chat.completions.create(
        model=model, temperature=0, max_tokens=100,
        messages=[{"role": "user", "content": "Give the capital of France and its population as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    answer = json.loads(response.choices[0].message.content or "")
    jsonschema.validate(answer, SCHEMA)
    assert answer["city"] == "Paris" and response.choices[0].finish_reason == "stop"
    # Asked for one word: else its first token is that of "The capital...", and the best prefix of a
    # choice is then "L" (London), a 135M model's choice.
    one_word = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    capital = client.chat.completions.create(
        model=model, temperature=0, max_tokens=10, messages=one_word,
        extra_body={"guided_choice": ["London", "Paris", "Berlin"]})
    assert capital.choices[0].message.content == "Paris"
