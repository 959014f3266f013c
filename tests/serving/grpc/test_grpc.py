"""The gRPC API end to end: the SDK against a live server on a free port, a real engine behind it."""

from __future__ import annotations

import asyncio
import filecmp
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from cluster.client import AsyncClient, Client, ClientError
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.serving.api_keys import ApiKeys
from cluster.serving.grpc.server import SERVICE_NAME, GrpcServer
from cluster.serving.local_service import LocalService
from cluster.serving.rate_limits import RateLimits
from cluster.state.connect import connect_state
from tests.helpers import fp32_model
from tests.serving.grpc.conftest import WAIT_S, ServerLoop, pool_is_whole, wait_until

ROOT = Path(__file__).resolve().parents[3]
PROMPT = "Hello world! How are you doing today?"
GREEDY = dict(temperature=0, ignore_eos=True)
LONG = 200  # tokens: seconds of work for the tiny model, which a test then cuts short


def target(server: GrpcServer) -> str:
    return f"127.0.0.1:{server.port}"


# ---- results ---------------------------------------------------------------------------------------

def test_stream_yields_every_token_once_in_order_and_matches_complete(client: Client) -> None:
    """One chunk per step while the reader keeps up; a reader that lags gets the steps it missed
    merged into one chunk (as vLLM's output collector does): indices stay contiguous either way."""
    with client.generate(PROMPT, max_tokens=12, **GREEDY) as stream:
        chunks = list(stream)
    assert [chunk.index for chunk in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    assert sum(len(chunk.token_ids) for chunk in chunks) == 12 and all(chunk.token_ids for chunk in chunks)
    assert [chunk.finished for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(chunk.request_id == stream.request_id for chunk in chunks)
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage is not None
    assert last.usage.completion_tokens == 12
    assert last.usage.total_tokens == last.usage.prompt_tokens + 12

    completion = client.complete(PROMPT, max_tokens=12, **GREEDY)
    assert completion.token_ids == [token for chunk in chunks for token in chunk.token_ids]
    assert completion.text == "".join(chunk.text for chunk in chunks)
    assert completion.finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (last.usage.prompt_tokens, 12)


def test_logit_bias_steers_sampling(client: Client) -> None:
    plain = client.complete(PROMPT, max_tokens=3, **GREEDY).token_ids
    token = 7 if 7 not in plain else 8
    assert client.complete(PROMPT, max_tokens=3, logit_bias={token: 100.0}, **GREEDY).token_ids == [token] * 3


def test_greedy_tokens_equal_the_engine_alone(client: Client, tiny_config: Callable[..., EngineConfig]) -> None:
    alone = LLMEngine(tiny_config()).generate([PROMPT], SamplingParams(max_tokens=16, **GREEDY))[0]
    assert client.complete(PROMPT, max_tokens=16, **GREEDY).token_ids == alone.token_ids


def test_token_ids_chat_and_logprobs(client: Client, service: LocalService) -> None:
    prompt_ids = service.tokenizer.encode(PROMPT)
    by_text = client.complete(PROMPT, max_tokens=6, **GREEDY)
    by_ids = client.complete(prompt_ids, max_tokens=6, logprobs=2, **GREEDY)
    assert by_ids.token_ids == by_text.token_ids
    assert [entry.token_id for entry in by_ids.logprobs] == by_ids.token_ids
    assert all(len(entry.top) == 2 and entry.logprob <= 0 for entry in by_ids.logprobs)

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.complete(chat, max_tokens=5, **GREEDY)
    expected = service.tokenizer.encode(service.tokenizer.apply_chat_template(chat), add_special_tokens=False)
    assert answer.usage.prompt_tokens == len(expected)
    assert client.list_models()[0].name == service.model_name


def test_prompt_logprobs_equal_the_engine_alone_and_come_once(client: Client, service: LocalService,
                                                              tiny_config: Callable[..., EngineConfig]) -> None:
    prompt_ids = service.tokenizer.encode(PROMPT)
    engine = LLMEngine(tiny_config())
    engine.add_request(prompt_ids, SamplingParams(max_tokens=3, prompt_logprobs=2, **GREEDY))
    first = engine.step()[0]
    assert first.prompt_logprobs is not None
    expected = [entry for entry in first.prompt_logprobs[1:] if entry is not None]
    with client.generate(prompt_ids, max_tokens=3, prompt_logprobs=2, **GREEDY) as stream:
        chunks = list(stream)
    streamed = chunks[0].prompt_logprobs
    assert [entry.token_id for entry in streamed] == prompt_ids[1:] == [entry.token_id for entry in expected]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected], abs=1e-5)
    assert [[token for token, _ in e.top] for e in streamed] == [[token for token, _ in e.top] for e in expected]
    assert not any(chunk.prompt_logprobs for chunk in chunks[1:])  # with the first token only
    whole = client.complete(prompt_ids, max_tokens=3, prompt_logprobs=2, **GREEDY).prompt_logprobs
    assert [entry.token_id for entry in whole] == prompt_ids[1:]


def test_include_stop_str_in_output_keeps_the_stop_string(client: Client) -> None:
    free = client.complete(PROMPT, max_tokens=16, **GREEDY).text
    stop = next(free[i:i + 2] for i in range(len(free) // 2, len(free) - 1) if free[i:i + 2].strip())
    kept = client.complete(PROMPT, max_tokens=16, stop=[stop], include_stop_str_in_output=True, **GREEDY)
    assert (kept.text, kept.finish_reason) == (free[:free.index(stop) + len(stop)], "stop")


def test_async_client(server_loop: ServerLoop, server: GrpcServer) -> None:
    async def body() -> tuple[list[Any], Any, str, list[Any]]:
        async with AsyncClient(target(server), timeout=WAIT_S) as client:
            async with client.generate(PROMPT, max_tokens=8, **GREEDY) as stream:
                chunks = [chunk async for chunk in stream]
            return chunks, await client.complete(PROMPT, max_tokens=8, **GREEDY), await client.health(), \
                await client.list_models()

    chunks, completion, health, models = server_loop.run(body())
    # In order, each token once; a chunk may carry several (a reader that lagged gets them merged).
    assert [chunk.index for chunk in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    assert sum(len(chunk.token_ids) for chunk in chunks) == 8
    assert "".join(chunk.text for chunk in chunks) == completion.text
    assert health == "SERVING" and len(models) == 1


# ---- cancellation frees the KV cache --------------------------------------------------------------

def exceed_deadline(call: Callable[[float], object]) -> ClientError:
    """The error of `call(timeout)`, with shorter timeouts until one passes before the work is done
    (a fast machine may finish it inside the first)."""
    for timeout in (0.5, 0.1, 0.02):
        try:
            call(timeout)
        except ClientError as error:
            return error
    pytest.fail("every call finished before its deadline")


def test_deadline_exceeded_aborts_the_request(client: Client, service: LocalService) -> None:
    error = exceed_deadline(lambda timeout: list(client.generate(PROMPT, max_tokens=LONG, timeout=timeout, **GREEDY)))
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(error).startswith("DEADLINE_EXCEEDED") and "the call's timeout was" in str(error)
    assert wait_until(lambda: pool_is_whole(service))

    error = exceed_deadline(lambda timeout: client.complete(PROMPT, max_tokens=LONG, timeout=timeout, **GREEDY))
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: pool_is_whole(service))


def test_leaving_a_stream_early_aborts_the_request(client: Client, service: LocalService,
                                                    server_loop: ServerLoop, server: GrpcServer) -> None:
    with client.generate(PROMPT, max_tokens=LONG, **GREEDY) as stream:
        next(stream)
        next(stream)
        assert not pool_is_whole(service)  # the request holds blocks...
    assert wait_until(lambda: pool_is_whole(service))  # ...until the stream is left

    async def leave_early() -> None:
        async with AsyncClient(target(server)) as async_client:
            stream = async_client.generate(PROMPT, max_tokens=LONG, **GREEDY)
            async for _ in stream:
                break
            await stream.aclose()
    server_loop.run(leave_early())
    assert wait_until(lambda: pool_is_whole(service))


def test_abort_by_request_id(client: Client, service: LocalService) -> None:
    stream = client.generate(PROMPT, max_tokens=LONG, **GREEDY)
    next(stream)
    client.abort(stream.request_id)
    assert list(stream)[-1].finish_reason == "abort"
    assert wait_until(lambda: pool_is_whole(service))


class FakeContext:
    """What InferenceServicer reads of a call's context, for driving it by hand."""

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


def test_an_abort_while_a_response_is_being_sent_ends_the_stream_at_its_next_step(
        server_loop: ServerLoop, service: LocalService) -> None:
    """Driven by hand, the call is held exactly where gRPC holds it while it sends a response (at its
    `yield`). An Abort then must not cancel the task driving it: there, the cancel landed in gRPC's
    own code and the stream hung until the client's deadline (about 1 abort in 30 did). The stream's
    next step is the "abort" message; the request's blocks come back."""
    from cluster.grpc_stubs import pdserve_pb2 as pb
    from cluster.serving.grpc.server import InferenceServicer

    async def body() -> list[Any]:
        servicer = InferenceServicer(service)
        request = pb.GenerateRequest(request_id="held", text=PROMPT,
                                     sampling=pb.SamplingParams(max_tokens=LONG, temperature=0))
        stream = servicer.Generate(request, FakeContext())  # type: ignore[arg-type]
        first = await anext(stream)  # now suspended at its yield, as while gRPC sends `first`
        await servicer.Abort(pb.AbortRequest(request_id="held"), FakeContext())  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # a cancel of this task would land here
        return [first] + [response async for response in stream]

    responses = server_loop.run(body())
    assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT and len(responses) < LONG
    assert wait_until(lambda: pool_is_whole(service))


def test_a_call_whose_response_stays_unsent_is_cancelled_and_its_request_aborted(
        server_loop: ServerLoop, service: LocalService) -> None:
    """A client that stops reading holds its call at the `yield` (HTTP/2 flow control holds gRPC's
    send): past the write timeout the call's task is cancelled, as gRPC ends a call, and the request
    is aborted, instead of the engine generating for nobody until the end."""
    from cluster.grpc_stubs import pdserve_pb2 as pb
    from cluster.serving.grpc.server import InferenceServicer

    async def body() -> tuple[bool, bool]:
        servicer = InferenceServicer(service, stream_write_timeout_s=0.3)
        request = pb.GenerateRequest(request_id="unread", text=PROMPT,
                                     sampling=pb.SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True))
        stream = servicer.Generate(request, FakeContext())  # type: ignore[arg-type]
        await anext(stream)  # suspended at its yield, as while gRPC waits to send the first response
        try:
            await asyncio.sleep(5)
            cut_off = False
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            cut_off = True
        running = service.engine.has_unfinished_requests()
        await stream.aclose()  # what gRPC does with a cancelled call's handler
        return cut_off, running

    step = service.engine.step
    service.engine.step = lambda: time.sleep(0.01) or step()  # type: ignore[method-assign]  # >= 2 s in all
    try:
        cut_off, running_when_cut = server_loop.run(body())
    finally:
        service.engine.step = step  # type: ignore[method-assign]
    assert cut_off and running_when_cut
    assert wait_until(lambda: pool_is_whole(service) and not service.engine.has_unfinished_requests())


def test_an_abort_ends_only_a_request_of_the_callers_own_key(server: GrpcServer, service: LocalService) -> None:
    """Request ids are scoped by the bearer a client sends: another key (or none) aborting the same id
    is a no-op, and the owner's stream runs to its end."""
    with Client(target(server), api_key="alice", timeout=WAIT_S * 3) as alice, \
            Client(target(server), api_key="bob", timeout=WAIT_S * 3) as bob, \
            Client(target(server), timeout=WAIT_S * 3) as anonymous:
        stream = alice.generate(PROMPT, request_id="shared", max_tokens=40, **GREEDY)
        next(stream)
        bob.abort("shared")
        anonymous.abort("shared")
        chunks = list(stream)
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 40
        assert all(chunk.request_id == "shared" for chunk in chunks)  # the client's id, echoed
        mine = alice.generate(PROMPT, request_id="shared", max_tokens=LONG, **GREEDY)
        next(mine)
        alice.abort("shared")
        assert list(mine)[-1].finish_reason == "abort"
    assert wait_until(lambda: pool_is_whole(service))


def test_request_ids_over_the_limit_or_in_flight_are_refused(client: Client, service: LocalService) -> None:
    with pytest.raises(ClientError) as refused:
        client.complete(PROMPT, request_id="x" * 129, max_tokens=2)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "128" in refused.value.details
    stream = client.generate(PROMPT, request_id="twice", max_tokens=30, **GREEDY)
    next(stream)
    with pytest.raises(ClientError) as in_use:
        client.complete(PROMPT, request_id="twice", max_tokens=2)
    assert in_use.value.code == grpc.StatusCode.ALREADY_EXISTS and "twice" in in_use.value.details
    assert list(stream)[-1].finish_reason == "length"  # the refusal did not end the first
    assert wait_until(lambda: pool_is_whole(service))


# ---- retries --------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_retries_until_the_server_is_up(server_loop: ServerLoop, service: LocalService) -> None:
    port = free_port()
    results: list[Any] = []

    def call() -> None:
        with Client(f"127.0.0.1:{port}", max_attempts=10, timeout=WAIT_S) as late_client:
            try:
                results.append(list(late_client.generate(PROMPT, max_tokens=4, **GREEDY)))
            except ClientError as error:
                results.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    threading.Event().wait(0.3)  # the first attempts find nobody listening
    server = server_loop.start_server(service, port=port)
    caller.join(WAIT_S)
    server_loop.run(server.stop(0))
    assert len(results) == 1 and not isinstance(results[0], ClientError), results
    chunks = results[0]  # a stream merges tokens its reader has not taken yet: count tokens, not chunks
    assert [chunk.index for chunk in chunks] == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    assert sum(len(chunk.token_ids) for chunk in chunks) == 4


def test_no_retry_once_a_token_arrived(server_loop: ServerLoop, service: LocalService) -> None:
    first = server_loop.start_server(service)
    with Client(target(first), max_attempts=10, timeout=WAIT_S) as restart_client:
        stream = restart_client.generate(PROMPT, max_tokens=LONG, **GREEDY)
        assert next(stream).index == 0
        server_loop.run(first.stop(0))
        # A replacement on the same port: a retry would reach it and silently start the answer over.
        second = server_loop.start_server(service, port=first.port)
        with pytest.raises(ClientError) as caught:
            indices = [chunk.index for chunk in stream]
            assert 0 not in indices
    server_loop.run(second.stop(0))
    assert caught.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert wait_until(lambda: pool_is_whole(service))


# ---- health, reflection, authentication -----------------------------------------------------------

def test_health_follows_the_service_and_drain(server_loop: ServerLoop,
                                              tiny_config: Callable[..., EngineConfig]) -> None:
    service = LocalService.from_config(tiny_config())  # not started: not ready
    server = server_loop.start_server(service)
    with Client(target(server), timeout=WAIT_S) as health_client:
        assert health_client.health() == "NOT_SERVING"
        assert health_client.health(SERVICE_NAME) == "NOT_SERVING"
        server_loop.run(service.start())
        assert wait_until(lambda: health_client.health() == health_client.health(SERVICE_NAME) == "SERVING")
        server_loop.run(server.drain())
        assert health_client.health() == health_client.health(SERVICE_NAME) == "NOT_SERVING"
        # In-flight work goes on (ignore_eos: the random model's EOS would end it with "stop" now and then).
        assert health_client.complete(PROMPT, max_tokens=2, **GREEDY).finish_reason == "length"
        with pytest.raises(ClientError) as caught:
            health_client.health("no.such.Service")
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
    server_loop.run(server.stop(0))
    server_loop.run(service.stop())


def test_reflection_lists_the_services(server: GrpcServer) -> None:
    with grpc.insecure_channel(target(server)) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert SERVICE_NAME in services and "grpc.health.v1.Health" in services


def test_api_key(server_loop: ServerLoop, service: LocalService) -> None:
    server = server_loop.start_server(service, api_key="s3cret")
    try:
        for key in (None, "wrong"):
            with Client(target(server), api_key=key, max_attempts=1) as anonymous:
                with pytest.raises(ClientError) as caught:
                    anonymous.list_models()
                assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(ClientError) as caught:
                    list(anonymous.generate(PROMPT, max_tokens=2))
                assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert anonymous.health() == "SERVING"  # probes send no key
        with Client(target(server), api_key="s3cret") as member:
            assert member.complete(PROMPT, max_tokens=2).usage.completion_tokens == 2
    finally:
        server_loop.run(server.stop(0))


def test_tenants_have_their_own_keys_rate_limits_and_request_ids(server_loop: ServerLoop,
                                                                    service: LocalService) -> None:
    """Several keys, one tenant each: rate limits on gRPC as on HTTP, per tenant, RESOURCE_EXHAUSTED
    with a retry-after; and a tenant's Abort cannot reach another's request."""
    tenants = ApiKeys.from_entries([{"name": "a", "key": "key-a"}, {"name": "b", "key": "key-b"},
                                    {"name": "fast", "key": "key-fast", "rate_limit_rps": 1000}])
    server = server_loop.start_server(service, api_key=tenants,
                                      limits=RateLimits(connect_state(""), requests_per_s=0.2))
    try:
        with Client(target(server), api_key="key-a", max_attempts=1) as a, \
                Client(target(server), api_key="key-b", max_attempts=1) as b, \
                Client(target(server), api_key="key-fast", max_attempts=1) as fast:
            stream = a.generate(PROMPT, request_id="mine", max_tokens=30, **GREEDY)
            next(stream)
            with pytest.raises(ClientError) as limited:
                a.complete(PROMPT, max_tokens=2)
            assert limited.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "per second" in limited.value.details
            b.abort("mine")  # another tenant: a no-op
            assert list(stream)[-1].finish_reason == "length"
            assert b.complete(PROMPT, max_tokens=2).usage.completion_tokens == 2
            assert [fast.complete(PROMPT, max_tokens=2).finish_reason for _ in range(3)] == ["length"] * 3
    finally:
        server_loop.run(server.stop(0))
    assert wait_until(lambda: pool_is_whole(service))


def test_cache_salt_and_per_key_isolation_partition_the_prefix_cache(
        server_loop: ServerLoop, tiny_config: Callable[..., EngineConfig]) -> None:
    """As on HTTP: under per-key isolation (the default) tenant B finds nothing of tenant A's prompt
    cached; a cache_salt shares blocks only with the same salt; under shared isolation keys share."""
    tenants = ApiKeys.from_entries([{"name": "a", "key": "key-a"}, {"name": "b", "key": "key-b"}])
    prompt = list(range(40, 61))  # 21 tokens: five full blocks of 4
    services = [server_loop.start_service(tiny_config()) for _ in range(2)]  # an empty prefix cache each
    per_key = server_loop.start_server(services[0], api_key=tenants)
    shared = server_loop.start_server(services[1], api_key=tenants, prefix_cache_isolation="shared")
    try:
        def cached(server: GrpcServer, key: str, **options: Any) -> int:
            with Client(target(server), api_key=key, max_attempts=1) as client:
                return client.complete(prompt, max_tokens=1, **options).usage.cached_tokens

        assert [cached(per_key, "key-a"), cached(per_key, "key-b"), cached(per_key, "key-a")] == [0, 0, 20]
        assert [cached(per_key, "key-a", cache_salt="s1"), cached(per_key, "key-a", cache_salt="s2"),
                cached(per_key, "key-a", cache_salt="s1")] == [0, 0, 20]
        assert [cached(shared, "key-a"), cached(shared, "key-b"), cached(shared, "key-b", cache_salt="s1"),
                cached(shared, "key-a", cache_salt="s1")] == [0, 20, 0, 20]
        for bad in ("", "x" * 257):
            with pytest.raises(ClientError) as refused:
                cached(shared, "key-a", cache_salt=bad)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "cache_salt" in refused.value.details
    finally:
        for server in (per_key, shared):
            server_loop.run(server.stop(0))
        for service in services:
            server_loop.run(service.stop())


def test_tls(server_loop: ServerLoop, service: LocalService) -> None:
    certificate, key = self_signed_certificate()
    server = server_loop.start_server(service, tls=(certificate, key))
    try:
        with Client(f"localhost:{server.port}", tls=certificate) as secure:
            assert secure.complete(PROMPT, max_tokens=2).usage.completion_tokens == 2
        with Client(f"localhost:{server.port}", max_attempts=1, timeout=WAIT_S) as plaintext, \
                pytest.raises(ClientError):
            plaintext.list_models()
    finally:
        server_loop.run(server.stop(0))


def self_signed_certificate() -> tuple[bytes, bytes]:
    """A certificate for "localhost" and its key, PEM, made with openssl (skips the test without it)."""
    import tempfile

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    with tempfile.TemporaryDirectory() as directory:
        cert, key = Path(directory, "cert.pem"), Path(directory, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=localhost", "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key),
                        "-out", str(cert)], check=True, capture_output=True)
        return cert.read_bytes(), key.read_bytes()


# ---- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt", "options", "code"), [
    (PROMPT, dict(temperature=-1), grpc.StatusCode.INVALID_ARGUMENT),
    (PROMPT, dict(top_p=0), grpc.StatusCode.INVALID_ARGUMENT),
    ([], {}, grpc.StatusCode.INVALID_ARGUMENT),
    ([5, 10**6], {}, grpc.StatusCode.INVALID_ARGUMENT),
    ([5] * 300, {}, grpc.StatusCode.INVALID_ARGUMENT),  # longer than the context
    ([{"role": "wizard", "content": "hi"}], {}, grpc.StatusCode.INVALID_ARGUMENT),  # the template refuses it
    (PROMPT, dict(model="gpt-7"), grpc.StatusCode.NOT_FOUND),
    (PROMPT, dict(priority=1), grpc.StatusCode.INVALID_ARGUMENT),  # the fcfs policy: priority scheduling is off
    (PROMPT, dict(logit_bias={5: 101.0}), grpc.StatusCode.INVALID_ARGUMENT),
    (PROMPT, dict(logit_bias={10**6: 1.0}), grpc.StatusCode.INVALID_ARGUMENT),  # past the vocabulary
    # Request limits on every byte a request brings: a grammar, and tools the template renders.
    (PROMPT, dict(structured={"regex": "a" * ((1 << 16) + 1)}), grpc.StatusCode.INVALID_ARGUMENT),
    ([{"role": "user", "content": "hi"}], dict(tools=[{"type": "function", "function": {
        "name": "f", "description": "x" * (1 << 20)}}]), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_requests(client: Client, prompt: Any, options: dict[str, Any], code: grpc.StatusCode) -> None:
    for call in (client.complete, lambda *args, **kwargs: list(client.generate(*args, **kwargs))):
        with pytest.raises(ClientError) as caught:
            call(prompt, max_tokens=2, **options)
        assert caught.value.code == code, caught.value
        assert "bytes" not in caught.value.details or "(max_" in caught.value.details  # a limit names itself


def test_unknown_sampling_option_fails_in_the_client(client: Client) -> None:
    with pytest.raises(TypeError, match="temprature"):
        client.generate(PROMPT, temprature=0)


def test_full_queue_is_resource_exhausted(server_loop: ServerLoop, tiny_config: Callable[..., EngineConfig]) -> None:
    # One running request, one waiting: a third finds the waiting queue full.
    service = server_loop.start_service(tiny_config(num_blocks=128, max_num_seqs=1, max_waiting_requests=1))
    server = server_loop.start_server(service)
    try:
        with Client(target(server), timeout=WAIT_S * 3) as busy_client:
            running = busy_client.generate(PROMPT, max_tokens=400, **GREEDY)
            next(running)
            waiting = busy_client.generate(PROMPT, max_tokens=400, **GREEDY)
            # Its first `next` would block until it runs: start it on a thread, then watch the queue.
            threading.Thread(target=lambda: _drain(waiting), daemon=True).start()
            assert wait_until(lambda: server_loop.run(service.workers())[0].num_waiting == 1)
            with pytest.raises(ClientError) as caught:
                busy_client.complete(PROMPT, max_tokens=4)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            running.close()
            busy_client.abort(waiting.request_id)  # not close(): its thread is inside next()
            assert wait_until(lambda: pool_is_whole(service))
    finally:
        server_loop.run(server.stop(0))
        server_loop.run(service.stop())


def test_priority_reaches_the_scheduler(server_loop: ServerLoop, tiny_config: Callable[..., EngineConfig]) -> None:
    service = server_loop.start_service(tiny_config(num_blocks=128, policy="priority"))
    server = server_loop.start_server(service)
    scheduler = service.engine.scheduler
    seen: list[int] = []
    add_request = scheduler.add_request

    def recording(request: Any) -> None:
        seen.append(request.priority)
        add_request(request)

    scheduler.add_request = recording  # type: ignore[method-assign]
    try:
        with Client(target(server), timeout=WAIT_S) as client:
            client.complete(PROMPT, max_tokens=2, priority=-2)
        assert seen == [-2]
    finally:
        server_loop.run(server.stop(0))
        server_loop.run(service.stop())


def _drain(stream: Any) -> None:
    try:
        for _ in stream:
            pass
    except (ClientError, ValueError):  # cancelled by the test, or closed while in use
        pass


# ---- the committed stubs ---------------------------------------------------------------------------

def test_committed_stubs_are_current(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("needs make")
    subprocess.run(["make", "-s", "proto", f"PROTO_OUT={tmp_path}", f"PY={sys.executable}"], cwd=ROOT,
                   check=True, capture_output=True)
    names = ["pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py"]
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "cluster" / "grpc_stubs", ROOT / "cluster" / "grpc_stubs",
                                           names, shallow=False)
    assert not mismatch and not errors, f"stale gRPC stubs {mismatch + errors}: run `make proto`"


def test_docs_examples_run(server: GrpcServer) -> None:
    """Every ```python block of docs/serving_grpc.md, pointed at this server (```py blocks are not run)."""
    examples = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "serving_grpc.md").read_text(), flags=re.DOTALL)
    assert len(examples) >= 6
    for example in examples:
        code = compile(example.replace("localhost:50051", target(server)), "docs/serving_grpc.md", "exec")
        exec(code, {"__name__": "__main__"})


# ---- the default model -----------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_answers_over_grpc(server_loop: ServerLoop) -> None:
    service = server_loop.start_service(EngineConfig(model=fp32_model(), cache=CacheConfig(kv_cache_memory_gb=0.25)))
    server = server_loop.start_server(service)
    try:
        with Client(target(server), timeout=120) as default_client:
            chat = [{"role": "user", "content": "What is the capital of France?"}]
            answer = default_client.complete(chat, max_tokens=32, temperature=0)
            streamed = "".join(chunk.text for chunk in default_client.generate(chat, max_tokens=32, temperature=0))
    finally:
        server_loop.run(server.stop(0))
        server_loop.run(service.stop())
    assert "Paris" in answer.text
    assert streamed == answer.text



# ---- connections ----------------------------------------------------------------------------------


def test_connections_past_the_limit_are_refused_and_silent_ones_closed(server_loop: ServerLoop,
                                                                       service: LocalService) -> None:
    import socket

    from cluster.grpc_stubs import pdserve_pb2 as pb
    from cluster.grpc_stubs import pdserve_pb2_grpc as pb_grpc
    from cluster.serving.connection_limits import ConnectionLimits

    server = server_loop.start_server(service, connections=ConnectionLimits(max_connections=2,
                                                                            request_read_timeout_s=0.5))
    request = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=2))

    def channel() -> grpc.Channel:  # a connection of its own (channels otherwise share one)
        return grpc.insecure_channel(target(server), options=[("grpc.use_local_subchannel_pool", 1)])

    try:
        first, second, third = channel(), channel(), channel()
        for open_channel in (first, second):
            pb_grpc.InferenceServiceStub(open_channel).Complete(request, timeout=WAIT_S)
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.InferenceServiceStub(third).Complete(request, timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        third.close()  # a refused channel keeps reconnecting: it would take the slot the next one waits for
        first.close()
        fourth = channel()
        assert wait_until(lambda: _completes(fourth, request))
        for open_channel in (second, fourth):
            open_channel.close()
        # A connection that never starts HTTP/2 is closed once the handshake deadline passes.
        silent = socket.create_connection(("127.0.0.1", server.port))
        silent.settimeout(10)
        started = time.monotonic()
        while silent.recv(1 << 16):
            pass
        assert time.monotonic() - started < 5
        silent.close()
    finally:
        server_loop.run(server.stop(0))


def _completes(channel: grpc.Channel, request: Any) -> bool:
    from cluster.grpc_stubs import pdserve_pb2_grpc as pb_grpc
    try:
        pb_grpc.InferenceServiceStub(channel).Complete(request, timeout=5)
    except grpc.RpcError:
        return False
    return True


def test_the_sdk_warns_when_it_would_send_an_api_key_in_plaintext_to_another_host() -> None:
    import warnings

    def made(client_class: type, target: str, **options: Any) -> None:
        async def inside_a_loop() -> None:  # the asyncio client's channel wants one
            client_class(target, **options)

        asyncio.run(inside_a_loop()) if client_class is AsyncClient else client_class(target, **options)

    for client_class in (Client, AsyncClient):
        with pytest.warns(UserWarning, match="API key goes to 10.1.2.3:50051 in plaintext"):
            made(client_class, "10.1.2.3:50051", api_key="secret")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # none of these warns
            made(client_class, "10.1.2.3:50051")  # no key to read
            made(client_class, "127.0.0.1:50051", api_key="secret")
            made(client_class, "localhost:50051", api_key="secret")
            made(client_class, "[::1]:50051", api_key="secret")
            made(client_class, "10.1.2.3:50051", api_key="secret", tls=True)
