"""The HTTP API fuzzed: from its own OpenAPI document with schemathesis, then with values no schema
admits, over a real socket to the real app and a real engine on the tiny random model.

Whatever comes in, the answer must come within a deadline, with a status and body the document
states, never a 5xx, and a stream must not end in an error event (a failure the 200 hides). The
engine must log no error (a failed step fails every request in it) and be left holding nothing:
every KV block back in the pool, no request running.

schemathesis' pytest integration for schemas from fixtures does not run on pytest 9 (it sets a node
attribute pytest removed), so each operation's cases are drawn here with plain hypothesis from
`APIOperation.as_strategy`, the API schemathesis offers for tests of one's own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode
from schemathesis.specs.openapi import checks as openapi_checks

# Imported at collection, not first in a fixture: pytest rewrites schemathesis' modules as they load,
# and CPython 3.11.7's parser can then fail deep in a fixture's stack ("SystemError: AST constructor
# recursion depth mismatch"), which it did once, at `from_url`'s first import of this module.
from schemathesis.specs.openapi import schemas as _openapi_schemas  # noqa: F401

from cluster.serving.http.openai_protocol import TEMPLATE_ARGUMENTS, ChatCompletionRequest, CompletionRequest
from cluster.serving.local_service import LocalService
from cluster.weights.tokenizer import Tokenizer
from tests.helpers import nothing_logged_and_idle
from tests.serving.http.conftest import LiveGateway, engine_idle

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
EXAMPLES_PER_OPERATION = 50
HOSTILE_EXAMPLES = 150
REQUEST_TIMEOUT_S = 10  # far above what a capped request needs, even on a busy machine: reaching it means a hang
# Generation is the one costly thing a request can ask for: a few tokens of a few choices.
MAX_TOKENS = 4
MAX_CHOICES = 2
CHAT_ROLES = ("system", "user", "assistant")  # the roles every chat template knows
CHECKS = [
    schemathesis.checks.not_a_server_error,
    openapi_checks.status_code_conformance,
    openapi_checks.content_type_conformance,
    openapi_checks.response_schema_conformance,
]


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def api_schema(tiny: LiveGateway) -> Any:
    """The document the running gateway serves, aimed at that gateway."""
    return schemathesis.openapi.from_url(f"{tiny.url}/openapi.json")


@pytest.fixture
def left_clean(tiny: LiveGateway, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """After the test: no error logged by the server or the engine, and the engine idle, pool whole."""
    with nothing_logged_and_idle(caplog, lambda: engine_idle(tiny.service)):
        yield


# ---- keeping requests cheap and reaching the engine -----------------------------------------------


def cheapen(body: Any, path: str, max_model_len: int) -> None:
    """Cap the generation a valid request asks for. Values no request may have (negative, past the
    context, more choices than allowed) are kept: they must still reach the checks that refuse them."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and MAX_TOKENS < value <= max_model_len:
            body[name] = MAX_TOKENS
    if path == CHAT and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # chat's default is the rest of the context
    n = body.get("n")
    if isinstance(n, int) and MAX_CHOICES < n <= 16:
        body["n"] = MAX_CHOICES


def aim(case: Case, service: LocalService) -> Case:
    """Steer a schema-valid case past what refuses most random requests and that the schema cannot
    tell (the served model's name, its vocabulary, the roles its chat template knows; `echo`, batches
    and non-text parts, which this server refuses), so its sampling values reach the engine."""
    body = case.body
    if not isinstance(body, dict):
        return case
    body["model"] = service.model_name
    body.pop("echo", None)
    if "prompt" in body:
        body["prompt"] = valid_prompt(body["prompt"], service.engine.arch.vocab_size)
    if isinstance(body.get("messages"), list):
        body["messages"] = [valid_message(message) for message in body["messages"]]
    return case


def valid_prompt(prompt: Any, vocab_size: int) -> Any:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # one prompt of a batch
    if isinstance(prompt, list):
        return [token % vocab_size for token in prompt]
    return prompt


def valid_message(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    message = {**message, "role": message["role"] if message.get("role") in CHAT_ROLES else "user"}
    if isinstance(message.get("content"), list):
        message["content"] = [{"type": "text", "text": str(part.get("text"))} for part in message["content"]]
    return message


def stream_errors(content_type: str, text: str) -> list[str]:
    """The error events of a streamed answer: failures after its 200 went out."""
    if not content_type.startswith("text/event-stream"):
        return []
    return [line for line in text.splitlines() if line.startswith('data: {"error"')]


# ---- from the OpenAPI document ---------------------------------------------------------------------


def fuzz_operation(operation: Any, service: LocalService) -> None:
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                      operation.as_strategy(GenerationMode.POSITIVE).map(lambda case: aim(case, service)),
                      operation.as_strategy(GenerationMode.NEGATIVE))

    @fuzz_settings(EXAMPLES_PER_OPERATION)
    @given(case=cases)
    def answers_as_documented(case: Case) -> None:
        cheapen(case.body, case.path, service.max_model_len)
        response = case.call_and_validate(checks=CHECKS, timeout=REQUEST_TIMEOUT_S)
        content_type = response.headers.get("content-type", [""])[0]  # schemathesis keeps every value
        assert not stream_errors(content_type, response.text), response.text

    answers_as_documented()


@pytest.mark.usefixtures("left_clean")
def test_every_documented_operation_answers_any_request_as_documented(api_schema: Any, tiny: LiveGateway) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {operation.path for operation in operations} >= {COMPLETIONS, CHAT}
    for operation in operations:
        try:
            fuzz_operation(operation, tiny.service)
        except Exception as error:
            error.add_note(f"while fuzzing {operation.label}")
            raise


# ---- values no schema admits -----------------------------------------------------------------------

# Lone UTF-16 surrogates ("\ud800" in JSON) decode into strings with no UTF-8 form; hypothesis'
# text never holds them, so they are mixed in by hand.
odd_text = st.text(st.characters() | st.integers(0xD800, 0xDFFF).map(chr), max_size=8)
# Past the edges of what fields take: non-finite floats, integers past 64 bits (torch's seeds), signs.
edge_values = st.sampled_from([math.nan, math.inf, -math.inf, 2**63, -(2**63) - 1, 2**64, 10**30, -1, 0, 1, True,
                               None, "", "\ud800"])
odd_scalars = st.one_of(edge_values, st.integers(), st.floats(), odd_text)
# NaN and Infinity are not JSON, but Python's json (the client's and the server's) writes and reads them.
odd_values = st.recursive(odd_scalars, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(odd_text, inner, max_size=3), max_leaves=6)
odd_template_variables = st.dictionaries(st.sampled_from([*TEMPLATE_ARGUMENTS, "bos_token", "eos_token"]) | odd_text,
                                         odd_values, max_size=3)
odd_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(CHAT_ROLES), "content": odd_text | odd_values},
    optional={"name": odd_values, "tool_calls": odd_values}), min_size=1, max_size=3)

BASE_BODIES = {COMPLETIONS: {"prompt": "Hello there", "max_tokens": 2},
               CHAT: {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}}
FIELDS = {COMPLETIONS: sorted(CompletionRequest.model_fields), CHAT: sorted(ChatCompletionRequest.model_fields)}
FIELD_VALUES = {"chat_template_kwargs": odd_template_variables, "messages": odd_messages | odd_values}


def changed(path: str, **fields: Any) -> tuple[str, dict[str, Any]]:
    return path, {**BASE_BODIES[path], **fields}


@st.composite
def odd_requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid body with one to three fields set to odd values."""
    path = draw(st.sampled_from(sorted(BASE_BODIES)))
    names = draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=3, unique=True))
    changes = {name: draw(FIELD_VALUES.get(name, edge_values | odd_values)) for name in names}
    return changed(path, **changes)


@pytest.mark.usefixtures("left_clean")
def test_values_no_schema_admits_get_a_400_not_a_crash(tiny: LiveGateway) -> None:
    with httpx.Client(base_url=tiny.url, timeout=REQUEST_TIMEOUT_S) as client:

        @fuzz_settings(HOSTILE_EXAMPLES)
        @given(request=odd_requests())
        # Once a failure: a seed torch cannot take (its failed step failed every request in it, and
        # this one 400 with torch's words), half a surrogate pair (500), a template variable that
        # collides with the template's own arguments (500).
        @example(changed(COMPLETIONS, seed=10**30))
        @example(changed(CHAT, messages=[{"role": "user", "content": "\ud800"}]))
        @example(changed(CHAT, chat_template_kwargs={"messages": 1}))
        def refused_or_answered(request: tuple[str, dict[str, Any]]) -> None:
            path, body = request
            cheapen(body, path, tiny.service.max_model_len)
            response = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
            assert response.status_code in (200, 400, 404), response.text
            if any(isinstance(value, float) and not math.isfinite(value) for value in body.values()):
                assert response.status_code == 400, response.text  # no field means NaN or an infinity
            assert not stream_errors(response.headers.get("content-type", ""), response.text), response.text
            if response.status_code != 200:
                assert response.json()["error"]["message"]

        refused_or_answered()


@pytest.mark.parametrize(("path", "fields", "param", "message"), [
    (COMPLETIONS, {"seed": 2**64}, "seed", "less than or equal to 9223372036854775807"),
    (COMPLETIONS, {"temperature": math.inf}, "temperature", "finite number"),
    (COMPLETIONS, {"top_p": math.nan}, "top_p", "finite number"),
    (COMPLETIONS, {"prompt": "\ud800"}, None, "unpaired UTF-16 surrogate"),
    (CHAT, {"chat_template_kwargs": {"add_generation_prompt": False}}, None, "cannot set add_generation_prompt"),
])
def test_what_the_fuzz_found_is_refused_with_a_400_that_says_why(tiny: LiveGateway, path: str, fields: dict[str, Any],
                                                                 param: str | None, message: str) -> None:
    _, body = changed(path, **fields)
    response = httpx.post(f"{tiny.url}{path}", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_a_chat_the_template_cannot_render_is_the_clients_error(tiny_checkpoint: Path) -> None:
    """The tiny model's template takes any message; real ones add fields such as `name` to strings,
    and a field the request does not type a client can send as anything (a number: a TypeError while
    rendering)."""
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    tokenizer.chat_template = "{% for message in messages %}{{ message.role + message.name }}{% endfor %}"
    request = ChatCompletionRequest(messages=[{"role": "assistant", "content": "", "name": 5}])
    with pytest.raises(ValueError, match="the chat template cannot render this request"):
        request.prompt_ids(tokenizer)
