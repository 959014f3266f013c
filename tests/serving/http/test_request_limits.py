"""What one request may ask (cluster.serving.request_limits) at the HTTP door: each bound is a 400
naming its limit, checked before any work; and work that must happen (tokenizing a large prompt)
does not hold the event loop that /health and every other stream share."""

from __future__ import annotations

import random
import string
import threading
import time
from typing import Any

import httpx
import pytest

from cluster.serving.request_limits import LimitExceeded, RequestLimits
from tests.serving.http.conftest import Gateways, LiveGateway, engine_idle, tiny_config, wait_until
from tests.serving.http.test_http_gateway import CHAT, assert_error

# A JSON schema of 3,000 properties: about 90 KB, over max_grammar_bytes (64 KiB), well under max_prompt_bytes.
PADDED_SCHEMA = {"type": "object", "properties": {f"field_{i:05d}": {"type": "string"} for i in range(3000)}}


@pytest.fixture
def client(tiny: LiveGateway) -> Any:
    with httpx.Client(base_url=tiny.url, timeout=60) as client:
        yield client


# ---- the limits themselves ---------------------------------------------------------------------------


def test_limits_parse_from_name_value_pairs_and_refuse_unknown_names_or_values() -> None:
    limits = RequestLimits.parse(["max_stop_strings=32", "max-messages=7"])
    assert (limits.max_stop_strings, limits.max_messages) == (32, 7)
    assert limits.max_prompt_bytes == RequestLimits().max_prompt_bytes == 1 << 20
    for bad in ("max_stop=3", "max_messages=0", "max_messages=-1", "max_messages=x", "max_messages"):
        with pytest.raises(ValueError):
            RequestLimits.parse([bad])


@pytest.mark.parametrize("check, limit", [
    (lambda limits: limits.check_prompt(1025, 0), "max_prompt_bytes"),
    (lambda limits: limits.check_prompt(10, 5), "max_messages"),
    (lambda limits: limits.check_sampling(["a"] * 5, []), "max_stop_strings"),
    (lambda limits: limits.check_sampling(["é" * 9], []), "max_stop_string_bytes"),  # 18 bytes
    (lambda limits: limits.check_sampling([], [1] * 5), "max_stop_token_ids"),
    (lambda limits: limits.check_sampling([], [], n=2, logprobs=4), "max_logprob_entries"),  # 2 x (4 + 1)
    (lambda limits: limits.check_grammar("é" * 9), "max_grammar_bytes"),  # 18 bytes
])
def test_each_limit_refuses_one_past_it_and_names_itself(check: Any, limit: str) -> None:
    limits = RequestLimits(max_prompt_bytes=1024, max_messages=4, max_stop_strings=4, max_stop_string_bytes=16,
                           max_stop_token_ids=4, max_logprob_entries=9, max_grammar_bytes=16)
    with pytest.raises(LimitExceeded, match=limit):
        check(limits)


def test_requests_at_every_limit_pass() -> None:
    limits = RequestLimits(max_prompt_bytes=1024, max_messages=4, max_stop_strings=4, max_stop_string_bytes=16,
                           max_stop_token_ids=4, max_logprob_entries=10, max_grammar_bytes=16)
    limits.check_grammar("é" * 8)
    limits.check_prompt(1024, 4)
    limits.check_sampling(["é" * 8] * 4, [1] * 4, n=2, logprobs=4)
    limits.check_sampling([], [], n=10, logprobs=0)


# ---- at the door -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, limit", [
    ("/v1/completions", {"prompt": "x" * ((1 << 20) + 1)}, "max_prompt_bytes"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "é" * (1 << 19)}] + CHAT},
     "max_prompt_bytes"),
    ("/v1/chat/completions", {"messages": CHAT * 1025}, "max_messages"),
    # What the template renders beside the messages counts as the prompt: tools, template arguments.
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "description": "x" * (1 << 20)}}]}, "max_prompt_bytes"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": {"padding": "x" * (1 << 20)}},
     "max_prompt_bytes"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a" * ((1 << 16) + 1)}, "max_grammar_bytes"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "padded", "schema": PADDED_SCHEMA}}}, "max_grammar_bytes"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": PADDED_SCHEMA}}]}, "max_grammar_bytes"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(300_000)]}, "max_stop_strings"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 257}, "max_stop_string_bytes"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(65))}, "max_stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "n": 16, "logprobs": 20}, "max_logprob_entries"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 8, "logprobs": True, "top_logprobs": 20},
     "max_logprob_entries"),
])
def test_a_request_over_a_limit_is_a_400_naming_it_and_nothing_runs(client: httpx.Client, tiny: LiveGateway,
                                                                      path: str, body: dict[str, Any],
                                                                      limit: str) -> None:
    error = assert_error(client.post(path, json={**body, "max_tokens": 2}), 400)
    assert limit in error["message"] and error["code"] == "request_limit_exceeded"
    assert engine_idle(tiny.service) and tiny.service.engine.scheduler.num_preemptions == 0


def test_limits_set_for_the_gateway_apply(gateways: Gateways, tiny_checkpoint: Any) -> None:
    service = gateways.start_service(tiny_config(tiny_checkpoint))
    gateway = gateways.serve(service, request_limits=RequestLimits(max_stop_strings=1))
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": ["a"]}).status_code == 200
        assert "max_stop_strings" in assert_error(client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stop": ["a", "b"]}), 400)["message"]


def random_words(nbytes: int, seed: int) -> str:
    """About `nbytes` of text in words of random letters: no two alike, as the tokenizer's word cache
    would otherwise make a second tokenizing of similar text far faster than the first."""
    generator = random.Random(seed)
    words = ("".join(generator.choices(string.ascii_lowercase, k=7)) for _ in range(nbytes // 8))
    return " ".join(words)


def test_health_answers_while_a_large_prompt_is_tokenized(client: httpx.Client, tiny: LiveGateway) -> None:
    """A prompt just under max_prompt_bytes takes seconds to tokenize on these CPUs. It is tokenized
    off the event loop, by code that lets other threads run: /health keeps answering meanwhile, far
    sooner than the tokenizing takes (on the loop, or holding the GIL, /health waited for all of it).
    Compared with the tokenizing's own time, measured here; this test's thread is starved alike when
    the GIL is held, so it also counts how often it got to ask."""
    started = time.perf_counter()
    tiny.service.tokenizer.encode(random_words(1 << 20, seed=1))  # other words: the tokenizer caches words
    tokenizing_s = time.perf_counter() - started
    text = random_words(1 << 20, seed=2)
    answers: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: answers.append(
        client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})))
    sender.start()
    gaps = []
    with httpx.Client(base_url=tiny.url, timeout=60) as health:
        while sender.is_alive():
            asked = time.perf_counter()
            assert health.get("/health").status_code == 200
            gaps.append(time.perf_counter() - asked)
            time.sleep(0.01)
    sender.join()
    assert answers and answers[0].status_code == 400  # tokenized, then too long for the context
    assert "context" in answers[0].json()["error"]["message"]
    assert len(gaps) > 3 and max(gaps) < tokenizing_s / 3, (len(gaps), max(gaps), tokenizing_s)
    assert wait_until(lambda: engine_idle(tiny.service))
