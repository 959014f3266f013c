"""vLLM's /tokenize and /detokenize: the prompt a generation request would cost, and back to text."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.serving.http.conftest import Gateways, LiveGateway

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(tiny: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny.url, timeout=60) as client:
        yield client


def test_tokenize_counts_what_a_completion_costs(client: httpx.Client, tiny: LiveGateway) -> None:
    answer = client.post("/tokenize", json={"prompt": "hello world"})
    assert answer.status_code == 200, answer.text
    tokens = answer.json()["tokens"]
    assert answer.json() == {"count": len(tokens), "max_model_len": tiny.service.max_model_len, "tokens": tokens,
                             "token_strs": None}
    usage = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == len(tokens)
    assert tokens == tiny.service.tokenizer.encode("hello world")
    plain = client.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert plain["tokens"] == tiny.service.tokenizer.encode("hello world", add_special_tokens=False)


def test_tokenize_a_chat_counts_what_a_chat_completion_costs(client: httpx.Client) -> None:
    answer = client.post("/tokenize", json={"messages": CHAT, "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    usage = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert answer.json()["count"] == usage["prompt_tokens"]
    assert len(answer.json()["token_strs"]) == answer.json()["count"]


def test_detokenize_inverts_tokenize(client: httpx.Client) -> None:
    tokens = client.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()["tokens"]
    answer = client.post("/detokenize", json={"tokens": tokens})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"prompt": "hello world"}


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/tokenize", {}, 400),
    ("/tokenize", {"messages": []}, 400),
    ("/tokenize", {"prompt": "hi", "model": "gpt-7"}, 404),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": [10**9]}, 400),
    ("/detokenize", {"tokens": [1], "model": "gpt-7"}, 404),
])
def test_bad_tokenizer_requests(client: httpx.Client, path: str, body: dict[str, object], status: int) -> None:
    answer = client.post(path, json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["message"]


def test_the_tokenizer_routes_need_the_api_key(gateways: Gateways, tiny: LiveGateway) -> None:
    guarded = gateways.serve(tiny.service, api_key="secret")
    with httpx.Client(base_url=guarded.url, timeout=60) as client:
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 401
        assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401
        headers = {"Authorization": "Bearer secret"}
        assert client.post("/tokenize", json={"prompt": "hi"}, headers=headers).status_code == 200
