"""Per-tenant rate limits and token quotas at both doors: 429 (RESOURCE_EXHAUSTED) with Retry-After,
shared through Redis; a tenant is an API key's, else a client address that no header can change
unless it comes from a trusted proxy."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from cluster.engine.config import CacheConfig, EngineConfig
from cluster.grammar.compiler import shared_compiler
from cluster.serving.api_keys import ApiKeys
from cluster.serving.http.gateway import HttpServer, build_app
from cluster.serving.local_service import LocalService
from cluster.serving.rate_limits import RateLimits
from cluster.state.connect import connect_state
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model
from tests.state.conftest import free_port


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def body(model: str, max_tokens: int = 5) -> dict[str, Any]:
    return {"model": model, "prompt": [5, 17, 33, 9], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


TENANTS = ApiKeys.from_entries([{"name": "a", "key": "key-a"}, {"name": "b", "key": "key-b"},
                                {"name": "fast", "key": "key-fast", "rate_limit_rps": 1000}])


async def gateways(checkpoint: Path, redis_url: str, count: int, api_key: str | ApiKeys = "",
                   trusted_proxies: str = "", **limits: float) -> tuple[LocalService, list]:
    """`count` gateways in front of one engine, each with its own connection to the shared state."""
    service = await LocalService.from_config(EngineConfig(model=fp32_model(checkpoint),
                                                          cache=CacheConfig(block_size=4, num_blocks=64))).start()
    servers = []
    for _ in range(count):
        app = build_app(service, api_key=api_key, limits=RateLimits(connect_state(redis_url), **limits))
        server = HttpServer(app, "127.0.0.1", 0, trusted_proxies=trusted_proxies)
        await server.start()
        servers.append(server)
    return service, servers


@pytest.mark.parametrize("where", ["in_process", "redis", "redis_down"])
def test_requests_per_second_per_tenant_shared_by_replicas(checkpoint: Path, redis_server: Any, where: str) -> None:
    """With Redis down, a gateway's limits fall back to its own buckets (docs/cluster.md): never off."""
    url = {"in_process": "", "redis": redis_server.url, "redis_down": f"redis://127.0.0.1:{free_port()}/0"}[where]

    async def main() -> None:
        # One gateway without Redis, or with it down (its own buckets); two replicas sharing Redis's.
        service, servers = await gateways(checkpoint, url, 2 if where == "redis" else 1, TENANTS, requests_per_s=0.2)
        try:
            key = {"Authorization": "Bearer key-a"}
            async with httpx.AsyncClient(timeout=60) as client:
                first = await client.post(servers[0].url + "/v1/completions", json=body(service.model_name),
                                          headers=key)
                assert first.status_code == 200
                second = await client.post(servers[-1].url + "/v1/completions", json=body(service.model_name),
                                           headers=key)
                assert second.status_code == 429  # burst of 1, refilled in 5 s: on the other replica too
                assert int(second.headers["Retry-After"]) >= 1
                assert second.json()["error"]["code"] == "rate_limit_exceeded"
                other = await client.post(servers[-1].url + "/v1/completions", json=body(service.model_name),
                                          headers={"Authorization": "Bearer key-b"})
                assert other.status_code == 200  # buckets are per tenant
                fast = [(await client.post(servers[-1].url + "/v1/completions", json=body(service.model_name),
                                           headers={"Authorization": "Bearer key-fast"})).status_code
                        for _ in range(3)]
                assert fast == [200] * 3  # its own limit: 1,000 per second
                stranger = await client.post(servers[-1].url + "/v1/completions", json=body(service.model_name),
                                             headers={"Authorization": "Bearer key-c"})
                assert stranger.status_code == 401
        finally:
            for server in servers:
                await server.stop()
            await service.stop()

    asyncio.run(main())


def test_tokens_per_minute_quota(checkpoint: Path) -> None:
    async def main() -> None:
        service, (server,) = await gateways(checkpoint, "", 1, tokens_per_min=30)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                statuses = [(await client.post("/v1/completions", json=body(service.model_name))).status_code
                            for _ in range(4)]
                assert statuses == [200, 200, 200, 429]  # 4 + 5 tokens each: 27 of 30, then 36
                too_big = await client.post("/v1/completions", json=body(service.model_name, max_tokens=40))
                assert too_big.status_code == 400 and "quota" in too_big.json()["error"]["message"]
        finally:
            await server.stop()
            await service.stop()

    asyncio.run(main())


@pytest.mark.parametrize("trusted", [False, True])
def test_without_keys_the_bucket_is_the_address_whatever_the_client_sends(checkpoint: Path, trusted: bool) -> None:
    """Keyless, a client is its address: a fresh bearer or X-Forwarded-For per request does not give it
    a fresh bucket (a bearer that names no key is no bucket of its own). X-Forwarded-For counts only from a
    trusted proxy: here the test itself, on 127.0.0.1, when `trusted`."""
    async def main() -> None:
        service, (server,) = await gateways(checkpoint, "", 1, "", "127.0.0.1" if trusted else "",
                                            requests_per_s=0.2)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                statuses = [(await client.post("/v1/completions", json=body(service.model_name), headers={
                    "Authorization": f"Bearer fresh-{index}", "X-Forwarded-For": f"10.9.8.{index}"})).status_code
                            for index in range(2)]
        finally:
            await server.stop()
            await service.stop()
        assert statuses == ([200, 200] if trusted else [200, 429])

    asyncio.run(main())


def test_tokenize_and_detokenize_count_against_requests_but_take_no_tokens(checkpoint: Path) -> None:
    async def main() -> None:
        service, (server,) = await gateways(checkpoint, "", 1, TENANTS, requests_per_s=0.2)
        quota_service, (quota_server,) = await gateways(checkpoint, "", 1, tokens_per_min=30)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                key = {"Authorization": "Bearer key-a"}
                assert (await client.post("/tokenize", json={"prompt": "Hello"}, headers=key)).status_code == 200
                refused = await client.post("/detokenize", json={"tokens": [5, 17]}, headers=key)
                assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["code"] == "rate_limit_exceeded"
                # One bucket for all the key's requests: the tokenize took this second's request.
                assert (await client.post("/v1/completions", json=body(service.model_name), headers=key)
                        ).status_code == 429
                other = {"Authorization": "Bearer key-b"}
                assert (await client.post("/detokenize", json={"tokens": [5]}, headers=other)).status_code == 200
            async with httpx.AsyncClient(base_url=quota_server.url, timeout=60) as client:
                long_prompt = {"prompt": "tokens " * 40}  # more tokens than the quota: it is not taken
                statuses = [(await client.post("/tokenize", json=long_prompt)).status_code for _ in range(3)]
                assert statuses == [200] * 3
                assert (await client.post("/v1/completions", json=body(service.model_name))).status_code == 200
        finally:
            await server.stop()
            await quota_server.stop()
            await service.stop()
            await quota_service.stop()

    asyncio.run(main())


def test_a_request_over_its_rate_limit_is_refused_before_any_work_for_it(checkpoint: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant limited to one request a second sends eight with a text prompt and a JSON schema at
    once: the seven refused are never tokenized and their grammars never compiled (nor cached), their
    bodies not even parsed, so a limited key cannot spend what every tenant shares."""
    async def main() -> list[int]:
        service, (server,) = await gateways(checkpoint, "", 1, TENANTS, requests_per_s=1)
        encode = service.tokenizer.encode
        monkeypatch.setattr(service.tokenizer, "encode", lambda *a, **k: (encoded.append(1), encode(*a, **k))[1])
        compiler = shared_compiler(service.tokenizer)
        misses = compiler.misses
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                requests = [client.post("/v1/completions", headers={"Authorization": "Bearer key-a"}, json={
                    "prompt": f"hello {index}", "max_tokens": 2, "guided_json": {"type": "object", "properties": {
                        f"field_{index}": {"type": "string"}}}}) for index in range(8)]
                statuses = sorted(response.status_code for response in await asyncio.gather(*requests))
                # Not even its body is read: one that is not JSON is refused by the limit, not as malformed.
                malformed = await client.post("/v1/completions", content=b"{not json", headers={
                    "Authorization": "Bearer key-a", "Content-Type": "application/json"})
        finally:
            await server.stop()
            await service.stop()
        assert (len(encoded), compiler.misses - misses) == (1, 1)
        return statuses + [malformed.status_code]

    encoded: list[int] = []
    assert asyncio.run(main()) == [200] + [429] * 7 + [429]
