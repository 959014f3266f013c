"""Every request field of OpenAI's two text endpoints and vLLM's extras: supported, refused or ignored.

The field lists come from the installed openai package, so a new openai release's new field fails
`test_every_field_is_classified` until `cluster.serving.http.request_fields` classifies it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from cluster.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from cluster.serving.http.request_fields import CHAT_FIELDS, COMPLETION_FIELDS, FieldRule, Status, markdown_table
from tests.serving.http.conftest import Gateways, LiveGateway, tiny_config

CHAT = [{"role": "user", "content": "hi"}]
DOC = Path(__file__).parents[3] / "docs" / "gateway.md"

# vLLM's extra request fields (vllm/entrypoints/openai/protocol.py), beyond OpenAI's.
VLLM_SHARED = (
    "best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
    "bad_words", "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority",
    "request_id", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "echo",
)
VLLM_CHAT = (*VLLM_SHARED, "add_generation_prompt", "continue_final_message", "documents", "chat_template",
             "chat_template_kwargs", "mm_processor_kwargs", "include_reasoning", "reasoning_effort")
VLLM_COMPLETION = (*VLLM_SHARED, "prompt_embeds")

ENDPOINTS: dict[str, tuple[type[SamplingRequest], Mapping[str, FieldRule], dict[str, Any]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, CHAT_FIELDS, {"messages": CHAT, "max_tokens": 4}),
    "/v1/completions": (CompletionRequest, COMPLETION_FIELDS, {"prompt": "hi", "max_tokens": 4}),
}


def openai_fields(params: type) -> set[str]:
    # `stream` is on the params' Streaming/NonStreaming subclasses only.
    return set(params.__annotations__) | {"stream"}


def fields_with(status: Status) -> list[tuple[str, str]]:
    return [(path, name) for path, (_, rules, _) in ENDPOINTS.items()
            for name, rule in rules.items() if rule.status is status]


@pytest.fixture
def client(tiny: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("rules", "known"), [
    (CHAT_FIELDS, openai_fields(chat_create_params.CompletionCreateParamsBase) | set(VLLM_CHAT)),
    (COMPLETION_FIELDS, openai_fields(completion_create_params.CompletionCreateParamsBase) | set(VLLM_COMPLETION)),
], ids=["chat", "completions"])
def test_every_field_is_classified(rules: Mapping[str, FieldRule], known: set[str]) -> None:
    assert sorted(known - rules.keys()) == []


@pytest.mark.parametrize(("path", "name"), fields_with(Status.SUPPORTED))
def test_a_supported_field_reaches_the_request_model(path: str, name: str) -> None:
    model, _, _ = ENDPOINTS[path]
    assert name in model.model_fields


@pytest.mark.parametrize(("path", "name"), fields_with(Status.IGNORED))
def test_an_ignored_field_is_no_request_model_field_but_user(path: str, name: str) -> None:
    model, _, _ = ENDPOINTS[path]
    assert name not in model.model_fields or name == "user"


@pytest.mark.parametrize(("path", "name"), fields_with(Status.REFUSED))
def test_a_refused_field_is_a_400_naming_it(client: httpx.Client, path: str, name: str) -> None:
    _, rules, body = ENDPOINTS[path]
    response = client.post(path, json={**body, name: "anything"})
    assert response.status_code == 400, response.text
    assert name in response.json()["error"]["message"]
    model = ENDPOINTS[path][0]
    for value in (None, *rules[name].accepted):  # values that ask for nothing pass
        model.model_validate({**body, name: value})


def test_refused_values_are_told_from_accepted_ones_by_type() -> None:
    with pytest.raises(ValueError, match="echo"):
        ChatCompletionRequest.model_validate({"messages": CHAT, "echo": 0})
    with pytest.raises(ValueError, match="modalities"):
        ChatCompletionRequest.model_validate({"messages": CHAT, "modalities": ["text", "audio"]})
    ChatCompletionRequest.model_validate({"messages": CHAT, "modalities": ["text"]})


@pytest.mark.parametrize("path", ENDPOINTS)
def test_ignored_fields_change_nothing(client: httpx.Client, path: str) -> None:
    _, rules, body = ENDPOINTS[path]
    body = {**body, "temperature": 0}
    ignored = {name: "anything" for name, rule in rules.items() if rule.status is Status.IGNORED}
    plain, tagged = client.post(path, json=body), client.post(path, json={**body, **ignored})
    assert plain.status_code == tagged.status_code == 200, tagged.text
    assert plain.json()["choices"] == tagged.json()["choices"]
    assert plain.json()["usage"]["prompt_tokens"] == tagged.json()["usage"]["prompt_tokens"]


def test_add_special_tokens_reaches_the_encoding() -> None:
    class Recorder:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [1, 2] if add_special_tokens else [2]

    tokenizer: Any = Recorder()
    assert CompletionRequest(prompt="hi").prompt_ids(tokenizer) == [1, 2]
    assert CompletionRequest(prompt="hi", add_special_tokens=False).prompt_ids(tokenizer) == [2]


def test_the_doc_lists_every_field_as_classified() -> None:
    regenerate = "regenerate docs/gateway.md's table: python -m cluster.serving.http.request_fields"
    assert markdown_table() in DOC.read_text(), regenerate


# ---- priority ---------------------------------------------------------------------------------------


def test_priority_is_a_400_unless_the_scheduler_runs_the_priority_policy(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 1})
    assert response.status_code == 400, response.text
    assert "priority scheduling is not enabled" in response.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 0}).status_code == 200


@pytest.mark.parametrize("path", ENDPOINTS)
def test_priority_reaches_the_scheduler(gateways: Gateways, tiny_checkpoint: Path, path: str) -> None:
    gateway = gateways.serve(gateways.start_service(tiny_config(tiny_checkpoint, policy="priority")))
    scheduler = gateway.service.engine.scheduler
    seen: list[int] = []
    add_request = scheduler.add_request

    def recording(request: Any) -> None:
        seen.append(request.priority)
        add_request(request)

    scheduler.add_request = recording  # type: ignore[method-assign]
    _, _, body = ENDPOINTS[path]
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        response = client.post(path, json={**body, "priority": -3, "n": 2})
    assert response.status_code == 200, response.text
    assert seen == [-3, -3]


# ---- logit_bias -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ENDPOINTS)
def test_logit_bias_steers_sampling(client: httpx.Client, tiny: LiveGateway, path: str) -> None:
    _, _, body = ENDPOINTS[path]
    body = {**body, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    tokenizer = tiny.service.tokenizer
    plain = text_of(client.post(path, json=body).json())
    token = next(token for token in range(40, 60)
                 if tokenizer.decode([token]) and tokenizer.decode([token] * 3) != plain)
    biased = client.post(path, json={**body, "logit_bias": {str(token): 100}})
    assert biased.status_code == 200, biased.text
    assert text_of(biased.json()) == tokenizer.decode([token] * 3)


def text_of(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])
