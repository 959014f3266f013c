"""Clients that hold the gateway's resources without using them: one that stops reading its stream
is disconnected and its request aborted; one that sends its request slowly is cut off; past the
connection limit new requests are refused at once. Raw sockets, so the client misbehaves exactly."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.engine.config import CacheConfig, EngineConfig
from cluster.serving.connection_limits import ConnectionLimits
from cluster.serving.http.gateway import EVENTS_AHEAD
from cluster.serving.local_service import LocalService
from tests.helpers import fp32_model
from tests.serving.http.conftest import Gateways, LiveGateway, engine_idle, paced, wait_until

MAX_TOKENS = 480


def _connect(gateway: LiveGateway, receive_buffer: int | None = None) -> socket.socket:
    host, port = gateway.url.removeprefix("http://").rsplit(":", 1)
    client = socket.socket()
    if receive_buffer is not None:  # before connecting: it sets the window the server sees
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    client.connect((host, int(port)))
    return client


def _request(body: dict[str, Any], path: str = "/v1/completions") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def _read_response(client: socket.socket) -> bytes:
    """One whole response with a Content-Length body (the connection stays open)."""
    client.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < _response_length(data):
        chunk = client.recv(1 << 16)
        assert chunk, f"the server closed the connection after {data!r}"
        data += chunk
    return data


def _response_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return len(head) + 4 + length


def _read_to_end(client: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything until the server closes the connection (raises TimeoutError if it does not)."""
    client.settimeout(timeout_s)
    chunks = []
    while chunk := client.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


class _Held:
    """The most that waited, at any sample, in the gateway's queues and the worker's output streams."""

    def __init__(self, gateway: LiveGateway, service: LocalService) -> None:
        self.gateway, self.service = gateway, service
        self.gateway_events = self.worker_outputs = 0

    def sample(self) -> bool:
        runs = list(self.gateway.app.state.gateway.runs)
        self.gateway_events = max([self.gateway_events, *(run.events_held() for run in runs)])
        streams = list(self.service.worker.streams.values())
        self.worker_outputs = max([self.worker_outputs, *(len(stream) for stream in streams)])
        return True


@pytest.fixture(scope="module")
def big_pool(tiny_checkpoint: Path) -> EngineConfig:
    # Room for 6 choices of a full 512-token context (the checkpoint's limit).
    return EngineConfig(model=fp32_model(tiny_checkpoint), cache=CacheConfig(block_size=16, num_blocks=256))


@pytest.fixture(scope="module")
def slow_engine(gateways: Gateways, big_pool: EngineConfig) -> Iterator[LocalService]:
    service = gateways.start_service(big_pool)
    yield service


def test_a_client_that_stops_reading_is_disconnected_and_its_request_aborted(
        gateways: Gateways, slow_engine: LocalService) -> None:
    # Answers of about 12 kB a step (6 choices x 20 top logprobs): the socket's bounded send buffer
    # fills within tens of steps, then the write waits for a client that never reads.
    gateway = gateways.serve(slow_engine, stream_write_timeout_s=1.0)
    steps = paced(slow_engine, 0.01)  # the whole answer would take at least 4.8 s
    client = _connect(gateway, receive_buffer=4096)
    try:
        client.sendall(_request({"prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "n": 6,
                                 "logprobs": 20, "temperature": 1.0, "stream": True}))
        assert wait_until(lambda: slow_engine.engine.has_unfinished_requests(), timeout_s=10)
        held = _Held(gateway, slow_engine)
        assert wait_until(lambda: held.sample() and engine_idle(slow_engine), timeout_s=30)
        ended_after = steps.count
        received = _read_to_end(client)  # the server hung up: it does not wait for the rest
    finally:
        client.close()
    assert ended_after < MAX_TOKENS, "the engine generated the whole answer for a client that read none of it"
    # Meanwhile what waited for the client stayed bounded: the gateway's events, the worker's outputs.
    assert 0 < held.gateway_events <= EVENTS_AHEAD + 2 * 6
    assert held.worker_outputs <= 2
    assert b"[DONE]" not in received and b"HTTP/1.1 200" in received
    assert not gateway.app.state.gateway.runs


def test_a_client_that_reads_slowly_but_steadily_gets_everything(gateways: Gateways,
                                                                 slow_engine: LocalService) -> None:
    """Backpressure, not loss: each pause is shorter than the write timeout, the answer is whole."""
    gateway = gateways.serve(slow_engine, stream_write_timeout_s=5.0)
    client = _connect(gateway, receive_buffer=4096)
    try:
        client.sendall(_request({"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "n": 6,
                                 "logprobs": 20, "temperature": 1.0, "stream": True}))
        time.sleep(2.0)  # the engine finishes meanwhile; the events wait, merged, behind the socket
        client.settimeout(10)
        data = b""
        while not data.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
            chunk = client.recv(1 << 12)
            assert chunk, "the server closed the stream early"
            data += chunk
            time.sleep(0.001)
    finally:
        client.close()
    text = data.decode(errors="replace")
    events = [json.loads(line.removeprefix("data: ")) for line in text.splitlines()
              if line.startswith("data: {")]
    tokens = {index: 0 for index in range(6)}
    for event in events:
        for choice in event["choices"]:
            tokens[choice["index"]] += len(choice["logprobs"]["tokens"]) if choice.get("logprobs") else 0
    assert tokens == {index: 200 for index in range(6)}
    assert wait_until(lambda: engine_idle(slow_engine), timeout_s=10)


def test_a_request_that_arrives_too_slowly_is_cut_off(gateways: Gateways, tiny: LiveGateway) -> None:
    gateway = gateways.serve(tiny.service, server_options={"connections": ConnectionLimits(request_read_timeout_s=0.5)})
    half_headers = _connect(gateway)
    half_body = _connect(gateway)
    try:
        half_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        half_body.sendall(_request({"prompt": "hello", "max_tokens": 2})[:-5])
        started = time.monotonic()
        assert _read_to_end(half_headers, timeout_s=5) == b""
        _read_to_end(half_body, timeout_s=5)
        assert time.monotonic() - started < 4
    finally:
        half_headers.close()
        half_body.close()
    # A whole request on a fresh connection is served, and its connection kept for the next one.
    client = _connect(gateway)
    try:
        client.sendall(_request({"prompt": "hello", "max_tokens": 2}))
        assert _read_response(client).startswith(b"HTTP/1.1 200")
        time.sleep(0.8)  # idle past the deadline, within keep-alive: the next request has its own
        client.sendall(_request({"prompt": "hello", "max_tokens": 2}))
        assert _read_response(client).startswith(b"HTTP/1.1 200")
    finally:
        client.close()


def test_past_the_connection_limit_new_requests_are_refused_at_once(gateways: Gateways, tiny: LiveGateway) -> None:
    gateway = gateways.serve(tiny.service, server_options={"connections": ConnectionLimits(max_connections=3)})
    idle = [_connect(gateway) for _ in range(3)]
    try:
        assert wait_until(lambda: len(gateway.server.server.server_state.connections) == 3, timeout_s=5)
        assert _status_line_of_a_request(gateway).startswith(b"HTTP/1.1 503")
    finally:
        for connection in idle:
            connection.close()
    assert wait_until(lambda: len(gateway.server.server.server_state.connections) == 0, timeout_s=5)
    assert _status_line_of_a_request(gateway).startswith(b"HTTP/1.1 200")


def _status_line_of_a_request(gateway: LiveGateway) -> bytes:
    """The start of the answer to a small completion on a connection of its own."""
    client = _connect(gateway)
    try:
        client.sendall(_request({"prompt": "hello", "max_tokens": 2}))
        client.settimeout(10)
        return client.recv(1 << 16)
    finally:
        client.close()
