"""`pdserve serve` on SIGTERM: refuses new requests, lets open streams finish, exits 0.

One real serving process on a tiny checkpoint (`--local`, no Ray): what Kubernetes does to a gateway
pod in a rollout (on the cluster path: tests/ray_cluster/test_sigterm_on_ray.py). Then, in
this process, the drain's bounds: a stream that outlives `--drain-s`, or a second signal, is cut and
its request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from cluster.serving.http.gateway import gateway_of
from cluster.serving.process import drain
from tests.serving.http.conftest import Gateways, engine_idle, paced, tiny_config, wait_until

START_TIMEOUT_S = 120.0
DRAIN_S = 120  # far more than the streams need: the drain ends when they do
NUM_STREAMS, MAX_TOKENS = 3, 300


def wait_for_log(log: Path, pattern: str, process: subprocess.Popen[bytes]) -> re.Match[str]:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if found := re.search(pattern, log.read_text()):
            return found
        assert process.poll() is None, f"the server exited with {process.returncode}:\n{log.read_text()}"
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in the server's log:\n{log.read_text()}")


async def data_lines(response: httpx.Response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


async def refused_or_503(client: httpx.AsyncClient) -> str:
    """What a new request gets once the server saw the signal (polling /ready until it says so)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while (await client.get("/ready")).status_code == 200:
            assert time.monotonic() < deadline, "still ready long after SIGTERM"
            await asyncio.sleep(0.05)
        response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    except httpx.ConnectError:
        return "refused"
    assert response.status_code == 503 and response.headers["retry-after"], response.text
    return "503"


async def stream_through_sigterm(url: str, pid: int) -> tuple[str, list[list[str]]]:
    """Open the streams, signal once each has its first chunk, then read them to their ends."""
    body = {"prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client, contextlib.AsyncExitStack() as stack:
        streams = [data_lines(await stack.enter_async_context(client.stream("POST", "/v1/completions", json=body)))
                   for _ in range(NUM_STREAMS)]
        firsts = [await anext(stream) for stream in streams]
        os.kill(pid, signal.SIGTERM)
        new_request = await refused_or_503(client)
        return new_request, [[first] + [data async for data in stream]
                             for first, stream in zip(firsts, streams, strict=True)]


def test_sigterm_finishes_open_streams_refuses_new_requests_and_exits_0(tiny_checkpoint: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "cluster.cli", "serve", "--local", "--model", str(tiny_checkpoint), "--host",
               "127.0.0.1", "--port", "0", "--grpc-port", "0", "--drain-s", str(DRAIN_S)]
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PDSERVE_API_KEY": ""})
    try:
        url = wait_for_log(log, r"HTTP on (http://\S+?),", process).group(1)
        wait_for_log(log, r"ready: serving", process)
        new_request, streams = asyncio.run(stream_through_sigterm(url, process.pid))
        assert process.wait(timeout=DRAIN_S + 60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    text = log.read_text()
    assert new_request in ("503", "refused")
    for stream in streams:
        assert stream[-1] == "[DONE]", stream[-3:]
        chunks = [json.loads(data) for data in stream[:-1]]
        assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == ["length"]
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    draining = re.search(r"draining for up to \d+s: (\d+) HTTP requests open", text)
    assert draining and int(draining.group(1)) >= 1, text  # the signal came while streams were open
    assert "still open" not in text and "Traceback" not in text, text
    assert "pdserve: stopped" in text


@pytest.mark.parametrize("case", ["past drain_s", "second signal"])
def test_a_drain_cuts_what_outlives_it(gateways: Gateways, tiny_checkpoint: Path, case: str) -> None:
    service = gateways.start_service(tiny_config(tiny_checkpoint))
    paced(service)  # 400 tokens: two seconds at least, against a drain of half of one
    live = gateways.serve(service)
    url = live.url
    hurried = asyncio.Event()
    if case == "second signal":
        hurried.set()
    drain_s = 0.5 if case == "past drain_s" else DRAIN_S

    async def stream_while_draining() -> list[str]:
        body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=url, timeout=120) as client, \
                client.stream("POST", "/v1/completions", json=body) as response:
            stream = data_lines(response)
            received = [await anext(stream)]
            draining = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
                drain(gateway_of(live.app), live.server, None, drain_s, hurried), gateways.loop.loop))
            with contextlib.suppress(httpx.RemoteProtocolError):  # the connection closes mid-stream
                async for data in stream:
                    received.append(data)
            await draining
            return received

    received = asyncio.run(stream_while_draining())
    assert "[DONE]" not in received
    assert wait_until(lambda: engine_idle(service))  # the cut stream's request was aborted
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")
