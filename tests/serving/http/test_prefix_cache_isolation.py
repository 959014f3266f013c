"""Tenants learn nothing of each other through the prefix cache: under per-key isolation a request
finds cached only the blocks of its own API key's requests (and of its own `cache_salt`), so
`usage.prompt_tokens_details.cached_tokens` (and the time to the first token) says nothing about
what another tenant sent. Real engines behind real gateways, two API keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.serving.api_keys import ApiKeys
from tests.serving.http.conftest import Gateways, tiny_config

TENANTS = ApiKeys.from_entries([{"name": "a", "key": "key-a"}, {"name": "b", "key": "key-b"}])
PROMPT = list(range(40, 61))  # 21 tokens: five full blocks of 4, all cached on a hit
CHAT = [{"role": "user", "content": "tell me about the weather in the mountains " * 4}]


@pytest.fixture
def serve(gateways: Gateways, tiny_checkpoint: Path) -> Callable[..., str]:
    """A gateway for the two tenants over an engine of its own (an empty prefix cache); its URL."""
    def start(**options: Any) -> str:
        service = gateways.start_service(tiny_config(tiny_checkpoint))
        return gateways.serve(service, api_key=TENANTS, **options).url
    return start


def post(url: str, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def cached(url: str, key: str, **fields: Any) -> int:
    """The cached_tokens of a completion of PROMPT sent with `key`."""
    response = post(url, key, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, **fields})
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def chat_cached(url: str, key: str, **fields: Any) -> int:
    response = post(url, key, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **fields})
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_under_per_key_isolation_another_tenant_finds_nothing_cached(serve: Callable[..., str]) -> None:
    url = serve(prefix_cache_isolation="per-key")
    assert cached(url, "key-a") == 0
    assert cached(url, "key-b") == 0  # B sends A's prompt: a miss, so B learns nothing of A
    assert cached(url, "key-a") == 20  # each tenant still reuses its own blocks
    assert cached(url, "key-b") == 20


def test_under_shared_isolation_tenants_share_the_prefix_cache(serve: Callable[..., str]) -> None:
    url = serve(prefix_cache_isolation="shared")
    assert cached(url, "key-a") == 0
    assert cached(url, "key-b") == 20  # what an operator whose tenants trust each other chooses


def test_tenants_are_isolated_by_default(serve: Callable[..., str]) -> None:
    url = serve()
    assert cached(url, "key-a") == 0
    assert cached(url, "key-b") == 0


def test_a_cache_salt_shares_blocks_only_with_requests_of_the_same_salt(serve: Callable[..., str]) -> None:
    url = serve(prefix_cache_isolation="shared")
    assert cached(url, "key-a", cache_salt="salt-1") == 0
    assert cached(url, "key-b", cache_salt="salt-2") == 0  # another salt: a miss
    assert cached(url, "key-b") == 0  # no salt: a miss too
    assert cached(url, "key-b", cache_salt="salt-1") == 20  # the same salt shares, across keys as vLLM
    assert chat_cached(url, "key-a", cache_salt="salt-1") == 0
    assert chat_cached(url, "key-a", cache_salt="salt-2") == 0
    assert chat_cached(url, "key-b", cache_salt="salt-1") > 0


def test_under_per_key_isolation_the_same_salt_does_not_cross_tenants(serve: Callable[..., str]) -> None:
    url = serve(prefix_cache_isolation="per-key")
    assert cached(url, "key-a", cache_salt="salt-1") == 0
    assert cached(url, "key-b", cache_salt="salt-1") == 0
    assert cached(url, "key-a", cache_salt="salt-1") == 20


@pytest.mark.parametrize("salt", ["", "x" * 257, "é" * 129, 7, ["a"]])
def test_a_cache_salt_must_be_a_non_empty_string_of_at_most_256_bytes(serve: Callable[..., str], salt: Any) -> None:
    url = serve()
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
        response = post(url, "key-a", path, {**body, "max_tokens": 1, "cache_salt": salt})
        assert response.status_code == 400, response.text
        assert "cache_salt" in response.text
    assert cached(url, "key-a", cache_salt="é" * 128) == 0  # 256 bytes: accepted
