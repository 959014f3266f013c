"""The OpenAI-compatible gateway, over real engines and real sockets.

Status codes and wire shapes run on a tiny random model (fast, meaningless text); answers, the
official openai client and client disconnects run on the default model (`slow`).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cluster.serving.http.gateway import HttpServer, gateway_of
from cluster.serving.http.openai_protocol import ChatCompletionRequest, CompletionRequest
from tests.serving.http.conftest import Gateways, LiveGateway, engine_idle, tiny_config, wait_until

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(tiny: LiveGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny.url, timeout=60) as client:
        yield client


def sse_data(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an event stream, JSON-decoded, "[DONE]" kept as a string."""
    payloads = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [payload if payload == "[DONE]" else json.loads(payload) for payload in payloads]


def assert_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"type", "param", "code"} <= error.keys()
    return error


# ---- request -> SamplingParams --------------------------------------------------------------------


def test_completion_max_tokens_default_is_16_shrunk_to_fit_and_explicit_values_must_fit() -> None:
    request = CompletionRequest(prompt="hi")
    assert request.sampling_params(10, 100)[0].max_tokens == 16
    assert request.sampling_params(90, 100)[0].max_tokens == 10
    with pytest.raises(ValueError, match="max_tokens is 50"):
        CompletionRequest(prompt="hi", max_tokens=50).sampling_params(60, 100)
    with pytest.raises(ValueError, match="context"):
        request.sampling_params(100, 100)


def test_chat_max_tokens_default_is_the_rest_of_the_context() -> None:
    request = ChatCompletionRequest(messages=CHAT)
    assert request.sampling_params(30, 100)[0].max_tokens == 70
    both = ChatCompletionRequest(messages=CHAT, max_tokens=5, max_completion_tokens=7)
    assert both.sampling_params(30, 100)[0].max_tokens == 7


def test_sampling_fields_reach_sampling_params() -> None:
    body = {"prompt": "hi", "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "presence_penalty": 0.2,
            "frequency_penalty": 0.3, "repetition_penalty": 1.1, "seed": 5, "stop": "x", "stop_token_ids": [3],
            "ignore_eos": True, "min_tokens": 2, "max_tokens": 9, "logprobs": 3, "n": 2, "user": None}
    first, second = CompletionRequest.model_validate(body).sampling_params(10, 100)
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (0.5, 0.9, 7, 0.1)
    assert (first.presence_penalty, first.frequency_penalty, first.repetition_penalty) == (0.2, 0.3, 1.1)
    assert (first.stop, first.stop_token_ids, first.ignore_eos, first.min_tokens) == (("x",), (3,), True, 2)
    assert (first.max_tokens, first.logprobs) == (9, 3)
    assert (first.seed, second.seed) == (5, 6)  # n choices with one seed must still differ


def test_chat_logprobs_flags() -> None:
    assert ChatCompletionRequest(messages=CHAT).sampling_params(1, 100)[0].logprobs is None
    assert ChatCompletionRequest(messages=CHAT, logprobs=True).sampling_params(1, 100)[0].logprobs == 0
    with_top = ChatCompletionRequest(messages=CHAT, logprobs=True, top_logprobs=4)
    assert with_top.sampling_params(1, 100)[0].logprobs == 4
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatCompletionRequest(messages=CHAT, top_logprobs=4).sampling_params(1, 100)


# ---- the tiny model: endpoints and shapes ---------------------------------------------------------


def test_health_ready_models_and_openapi(client: httpx.Client, tiny: LiveGateway) -> None:
    assert client.get("/health").status_code == 200
    assert client.get("/ready").json() == {"status": "ready"}
    name = tiny.service.model_name
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [name]
    assert client.get(f"/v1/models/{name}").json()["max_model_len"] == tiny.service.max_model_len
    assert_error(client.get("/v1/models/gpt-4"), 404)
    document = client.get("/openapi.json").json()
    assert "/v1/chat/completions" in document["paths"]
    statuses = {status for operations in document["paths"].values() for operation in operations.values()
                for status in operation["responses"]}
    assert "400" in statuses and "422" not in statuses  # the gateway answers 400, never FastAPI's 422
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_request_ids_are_echoed_or_made(client: httpx.Client) -> None:
    body = {"prompt": "Hello", "max_tokens": 2}
    given = client.post("/v1/completions", json=body, headers={"X-Request-Id": "my-id-1"})
    assert given.headers["x-request-id"] == "my-id-1" == given.json()["id"]
    made = client.post("/v1/completions", json=body)
    assert made.headers["x-request-id"].startswith("cmpl-") and made.json()["id"] == made.headers["x-request-id"]
    chat = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert chat.headers["x-request-id"].startswith("chatcmpl-")
    assert_error(client.post("/v1/completions", json={**body, "model": "nope"}), 404)
    assert client.get("/health").headers["x-request-id"]


@pytest.mark.parametrize("given", ["x" * 129, "tab\there"], ids=["too-long", "unprintable"])
def test_a_request_id_over_the_limit_is_a_400_naming_it(client: httpx.Client, given: str) -> None:
    response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                           headers={"X-Request-Id": given})
    error = assert_error(response, 400)
    assert "X-Request-Id" in error["message"] and "128" in error["message"]
    assert response.headers["x-request-id"] != given


def test_a_client_cannot_end_another_clients_request_by_reusing_its_id(client: httpx.Client, tiny: LiveGateway) -> None:
    """Two clients that send the same X-Request-Id are two requests: the second is not refused and
    does not end the first (the gateway names requests itself; a client's id is only echoed)."""
    long_body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    headers = {"X-Request-Id": "shared-id"}
    with client.stream("POST", "/v1/completions", json=long_body, headers=headers) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the first is streaming
        second = client.post("/v1/completions", json={"prompt": [9, 9], "max_tokens": 3}, headers=headers)
        assert second.status_code == 200, second.text
        assert second.json()["id"] == "shared-id"
        rest = [json.loads(line.removeprefix("data: ")) for line in lines
                if line.startswith("data: ") and line != "data: [DONE]"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert wait_until(lambda: engine_idle(tiny.service))


def test_completion_of_token_ids_counts_usage_and_logprobs(client: httpx.Client) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 7, "ignore_eos": True, "logprobs": 2, "temperature": 0}
    response = client.post("/v1/completions", json=body).json()
    (choice,) = response["choices"]
    assert choice["finish_reason"] == "length"
    usage = response["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (4, 7, 11)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 7
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_stream_equals_the_whole_response(client: httpx.Client) -> None:
    body = {"prompt": "Hello world", "max_tokens": 12, "ignore_eos": True, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_data(response)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(chunk["object"] == "text_completion" and chunk["id"] == chunks[0]["id"] for chunk in chunks)
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert without_cached_tokens(usage_chunk["usage"]) == without_cached_tokens(whole["usage"])


def without_cached_tokens(usage: dict[str, Any]) -> dict[str, Any]:
    """A usage to compare with another request's: the second of two alike finds the first's prompt cached."""
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(client: httpx.Client) -> None:
    body = {"prompt": list(range(40, 61)), "max_tokens": 1}  # 21 tokens: five full blocks of 4
    first = client.post("/v1/completions", json=body).json()["usage"]
    second = client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": 20}


def test_chat_stream_fans_out_n_choices(client: httpx.Client) -> None:
    body = {"messages": CHAT, "max_tokens": 5, "ignore_eos": True, "n": 3, "seed": 1, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = sse_data(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None for chunk in chunks)
    openings = [chunk["choices"][0] for chunk in chunks[:3]]
    assert [(c["index"], c["delta"]) for c in openings] == [(i, {"role": "assistant", "content": ""}) for i in range(3)]
    finished = {chunk["choices"][0]["index"] for chunk in chunks if chunk["choices"][0]["finish_reason"] == "length"}
    assert finished == {0, 1, 2}


# ---- the tiny model: every error status -----------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}),
    ("/v1/completions", {"prompt": {"text": "hi"}}),
    ("/v1/completions", {}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}),
    ("/v1/completions", {"prompt": [7] * 600}),  # longer than the 512-token context
    ("/v1/completions", {"prompt": [99_999]}),  # not in the vocabulary: refused by the engine
    ("/v1/completions", {"prompt": [5, 99_999], "echo": True}),  # refused before the echo decodes it
    ("/v1/completions", {"prompt": [5, -3_554_628_007_947_573_133_312], "echo": True}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {"prompt": ["one", "two"]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),  # 0 only with echo (the prompt alone)
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"five": 1}}),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 1}}),  # past the vocabulary: the engine refuses it
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}),
    ("/v1/completions", {"prompt": "hi", "n": 0}),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
])
def test_invalid_requests_get_400(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    error = assert_error(client.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_gets_400(client: httpx.Client) -> None:
    response = client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_error(response, 400)


def test_unknown_model_and_route_get_404(client: httpx.Client) -> None:
    error = assert_error(client.post("/v1/completions", json={"prompt": "hi", "model": "gpt-4"}), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert_error(client.post("/v1/chat/completions", json={"messages": CHAT, "model": "gpt-4"}), 404)
    assert_error(client.get("/v1/nowhere"), 404)


def test_bodies_over_the_limit_get_413(gateways: Gateways, tiny: LiveGateway) -> None:
    small = gateways.serve(tiny.service, max_body_bytes=1024)
    body = json.dumps({"prompt": "x" * 2000}).encode()

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies as the body streams in
        yield from (body[i:i + 500] for i in range(0, len(body), 500))

    with httpx.Client(base_url=small.url, timeout=60) as client:
        headers = {"Content-Type": "application/json"}
        assert assert_error(client.post("/v1/completions", content=body, headers=headers), 413)
        assert_error(client.post("/v1/completions", content=chunked(), headers=headers), 413)
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_api_key_is_required_when_set(gateways: Gateways, tiny: LiveGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    keyed = gateways.serve(tiny.service, api_key="sesame")
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    from_env = gateways.serve(tiny.service)
    body = {"prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=keyed.url, timeout=60) as client:
        assert_error(client.post("/v1/completions", json=body), 401)
        assert_error(client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame2"}), 401)
        assert_error(client.get("/v1/models", headers={"Authorization": "Basic sesame"}), 401)
        assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}).status_code == 200
        assert client.get("/health").status_code == 200 and client.get("/ready").status_code == 200
    with httpx.Client(base_url=from_env.url, timeout=60) as client:
        assert_error(client.get("/v1/models"), 401)
        assert client.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_full_queue_gets_429_with_retry_after(gateways: Gateways, tiny_checkpoint: Path) -> None:
    # One request runs, one waits, the rest find the queue full.
    service = gateways.start_service(tiny_config(tiny_checkpoint, max_num_seqs=1, max_waiting_requests=1))
    live = gateways.serve(service)
    body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}

    def burst() -> list[httpx.Response]:
        with httpx.Client(base_url=live.url, timeout=120) as client, ThreadPoolExecutor(6) as pool:
            return list(pool.map(lambda i: client.post("/v1/completions", json={**body, "stream": i % 2 == 1}),
                                 range(6)))

    for _ in range(3):  # a burst that arrives slower than two requests run is retried, not failed
        responses = burst()
        assert {response.status_code for response in responses} <= {200, 429}
        refused = [response for response in responses if response.status_code == 429]
        if refused:
            break
    assert refused and 200 in {response.status_code for response in responses}
    assert refused[0].headers["retry-after"] == "1"
    assert_error(refused[0], 429)
    assert wait_until(lambda: engine_idle(service))


def test_unready_service_and_draining_get_503(gateways: Gateways, tiny: LiveGateway, tiny_checkpoint: Path) -> None:
    starting = gateways.serve(gateways.start_service(tiny_config(tiny_checkpoint), start=False))
    draining = gateways.serve(tiny.service)
    gateway_of(draining.app).start_draining()
    for live in (starting, draining):
        with httpx.Client(base_url=live.url, timeout=60) as client:
            assert client.get("/health").status_code == 200
            assert client.get("/ready").status_code == 503
            response = client.post("/v1/completions", json={"prompt": "hi"})
            assert_error(response, 503)
            assert response.headers["retry-after"]
            assert_error(client.post("/v1/chat/completions", json={"messages": CHAT}), 503)
    assert gateways.loop.run(gateway_of(draining.app).drain(timeout_s=5))


def test_a_port_in_use_raises_instead_of_exiting(gateways: Gateways, tiny: LiveGateway) -> None:
    taken = HttpServer(tiny.app, "127.0.0.1", tiny.server.port)
    with pytest.raises(OSError):
        gateways.loop.run(taken.start())


def test_https_with_a_certificate_and_nothing_in_plain_text(gateways: Gateways, tiny: LiveGateway,
                                                           tmp_path: Path) -> None:
    from tests.serving.grpc.test_grpc import self_signed_certificate

    certificate, key = self_signed_certificate()
    (tmp_path / "cert.pem").write_bytes(certificate)
    (tmp_path / "key.pem").write_bytes(key)
    server = HttpServer(tiny.app, "localhost", 0, tls=(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")))
    gateways.loop.run(server.start())
    try:
        assert server.url.startswith("https://localhost:")
        with httpx.Client(verify=ssl.create_default_context(cafile=tmp_path / "cert.pem"), timeout=30) as secure:
            assert secure.get(server.url + "/health").json() == {"status": "ok"}
            answer = secure.post(server.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
            assert answer.status_code == 200
        with httpx.Client(timeout=30) as plain, pytest.raises(httpx.HTTPError):
            plain.get(server.url.replace("https://", "http://") + "/health")
    finally:
        gateways.loop.run(server.stop())


# ---- the default model: real answers through the official client ----------------------------------


@pytest.fixture(scope="module")
def openai_client(default_gateway: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{default_gateway.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_chat_answers_with_usage_and_logprobs(openai_client: openai.OpenAI, default_gateway: LiveGateway) -> None:
    response = openai_client.chat.completions.create(
        model=default_gateway.service.model_name, messages=CHAT, temperature=0, max_tokens=24, logprobs=True,
        top_logprobs=2)
    choice = response.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == usage.completion_tokens  # one entry per generated token
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


@pytest.mark.slow
def test_completion_stops_before_a_stop_string(openai_client: openai.OpenAI, default_gateway: LiveGateway) -> None:
    model, prompt = default_gateway.service.model_name, "The capital of France is"
    free = openai_client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12)
    text = free.choices[0].text
    assert free.choices[0].finish_reason == "length" and free.usage and free.usage.completion_tokens == 12
    stop = text.split()[1]  # a word in the middle of the answer
    stopped = openai_client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12,
                                               stop=[stop, "never-generated"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(stop)] and stop not in stopped.choices[0].text


@pytest.mark.slow
def test_chat_stream_with_usage_matches_the_whole_answer(openai_client: openai.OpenAI,
                                                         default_gateway: LiveGateway) -> None:
    options: dict[str, Any] = dict(model=default_gateway.service.model_name, messages=CHAT, temperature=0,
                                   max_tokens=16)
    whole = openai_client.chat.completions.create(**options)
    chunks = list(openai_client.chat.completions.create(**options, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == \
        whole.usage.model_dump(exclude={"prompt_tokens_details"})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


@pytest.mark.slow
def test_async_client_n_choices_and_streamed_completion(default_gateway: LiveGateway) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{default_gateway.url}/v1", api_key="unused", max_retries=0)
        model = default_gateway.service.model_name
        response = await client.completions.create(model=model, prompt="Once upon a time", n=2, temperature=0.8,
                                                   seed=3, max_tokens=8, logprobs=1)
        assert sorted(choice.index for choice in response.choices) == [0, 1]
        tokens = [len(choice.logprobs.tokens or []) for choice in response.choices if choice.logprobs]
        assert response.usage is not None and sum(tokens) == response.usage.completion_tokens
        stream = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                                 temperature=0, stream=True)
        pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert len("".join(pieces)) > 0
        await client.close()

    asyncio.run(run())


# ---- the default model: a client that leaves frees its blocks -------------------------------------


LONG_CHAT = {"messages": CHAT, "max_tokens": 2000, "ignore_eos": True}  # minutes of work unless aborted


@pytest.mark.slow
def test_closed_stream_aborts_its_request(default_gateway: LiveGateway) -> None:
    service = default_gateway.service
    request = {**LONG_CHAT, "stream": True}
    with httpx.Client(base_url=default_gateway.url, timeout=60) as client, \
            client.stream("POST", "/v1/chat/completions", json=request) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
        assert service.engine.has_unfinished_requests()
    assert wait_until(lambda: engine_idle(service), timeout_s=10)


@pytest.mark.slow
def test_client_leaving_a_whole_response_aborts_its_request(default_gateway: LiveGateway) -> None:
    service = default_gateway.service
    with httpx.Client(base_url=default_gateway.url, timeout=1.5) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=LONG_CHAT)
    assert wait_until(lambda: engine_idle(service), timeout_s=10)


def test_a_stream_that_fails_after_its_status_line_says_why_in_band() -> None:
    """The status line is gone once a stream started: the error event carries the status a client
    would have had and why (the only decode worker died and did not come back: retry), never a bare
    "internal error" for something the client can act on."""
    from cluster.common.errors import NoCapacityError, ServiceUnavailable
    from cluster.serving.http.gateway import _stream_error

    gone = _stream_error("r", ServiceUnavailable("no decode worker is alive: retry later"))
    assert (gone.type, gone.code) == ("service_unavailable", "503")
    assert gone.message == "no decode worker is alive: retry later"
    full = _stream_error("r", NoCapacityError("no decode worker has room"))
    assert (full.type, full.code) == ("rate_limit_error", "rate_limit_exceeded")
    broken = _stream_error("r", KeyError("x"))
    assert (broken.type, broken.message) == ("server_error", "internal error: KeyError")
