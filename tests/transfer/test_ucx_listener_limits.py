"""A decode worker's KV listener under peers that connect and never speak, or too many at once: each
is closed within its deadline and its serving task freed, the endpoints past the bound are refused,
and a real sender's transfer still lands."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from cluster.transfer import ucx
from tests.transfer.conftest import BODY_TIMEOUT_S, HAS_UCXX, TIMEOUT_S
from tests.transfer.test_connectors import header_for, random_payload

pytestmark = pytest.mark.skipif(not HAS_UCXX, reason="ucxx is not installed (pip install ucxx-cu13)")
DEADLINE_S = 0.5  # the test receivers' handshake and idle timeouts


def run(loop: asyncio.AbstractEventLoop, coroutine: Any) -> Any:
    return loop.run_until_complete(asyncio.wait_for(coroutine, BODY_TIMEOUT_S))


@pytest.fixture
def receiver(loop: asyncio.AbstractEventLoop) -> Iterator[ucx.UCXReceiver]:
    receiver = ucx.UCXReceiver(timeout_s=TIMEOUT_S, shared_memory=False, max_endpoints=4,
                               handshake_timeout_s=DEADLINE_S, idle_timeout_s=2 * DEADLINE_S)
    run(loop, receiver.start())
    yield receiver
    run(loop, receiver.close())


async def silent(address: str, count: int) -> list[Any]:
    """`count` endpoints to `address` that never send a byte (raw ucxx: no `UCXSender` protocol)."""
    host, port = ucx.parse_address(address)
    return [await ucx.init_ucx().create_endpoint(host, port) for _ in range(count)]


async def until(condition: Any, within_s: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < within_s, "not within the deadline"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def test_connections_that_never_speak_are_closed_after_the_handshake_timeout(
        loop: asyncio.AbstractEventLoop, receiver: ucx.UCXReceiver) -> None:
    async def body() -> float:
        endpoints = await silent(receiver.address, 3)
        await until(lambda: len(receiver._links) == 3, 2.0)  # noqa: SLF001 (the serving tasks' links)
        took = await until(lambda: not receiver._links, 4 * DEADLINE_S)  # noqa: SLF001
        await until(lambda: all(endpoint.closed for endpoint in endpoints), 2.0)  # the peer sees it go
        return took

    assert run(loop, body()) <= 4 * DEADLINE_S


def test_past_the_bound_new_endpoints_are_refused_while_a_real_transfer_lands(
        loop: asyncio.AbstractEventLoop, receiver: ucx.UCXReceiver, caplog: pytest.LogCaptureFixture) -> None:
    sender = ucx.UCXSender(timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S, shared_memory=False)
    first, second = np.zeros(1024, np.uint8), np.zeros(1024, np.uint8)
    data = random_payload(1024).reshape(-1)

    async def body() -> None:
        done = receiver.expect("r1", memoryview(first))
        await sender.send(receiver.address, header_for("r1", 1024), memoryview(data))  # its endpoint: pooled
        await done
        flood = await silent(receiver.address, 6)  # 3 more fit the bound of 4; 3 are refused
        await until(lambda: sum(endpoint.closed for endpoint in flood) >= 3, 2.0)
        assert len(receiver._links) == 4  # noqa: SLF001
        done = receiver.expect("r2", memoryview(second))
        await sender.send(receiver.address, header_for("r2", 1024), memoryview(data))  # the pooled one still serves
        await done
        await sender.close()

    run(loop, body())
    assert np.array_equal(first, data) and np.array_equal(second, data)
    assert "refused an endpoint" in caplog.text


def test_an_idle_endpoint_is_closed_and_its_sender_opens_a_new_one(loop: asyncio.AbstractEventLoop,
                                                                   receiver: ucx.UCXReceiver) -> None:
    """The sender retires a pooled endpoint before the receiver's idle timeout (as `UCXSender`'s
    default, half of `IDLE_TIMEOUT_S`): its next transfer takes a new one instead of a closing one."""
    sender = ucx.UCXSender(timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S, shared_memory=False,
                           max_idle_s=DEADLINE_S)
    buffers = [np.zeros(1024, np.uint8) for _ in range(2)]
    data = random_payload(1024).reshape(-1)

    async def body() -> None:
        for index, buffer in enumerate(buffers):
            done = receiver.expect(f"i{index}", memoryview(buffer))
            await sender.send(receiver.address, header_for(f"i{index}", 1024), memoryview(data))
            await done
            await until(lambda: not receiver._links, 6 * DEADLINE_S)  # noqa: SLF001 (idle: closed, freed)
        await sender.close()

    run(loop, body())
    assert all(np.array_equal(buffer, data) for buffer in buffers)


def test_idle_connections_do_not_each_wake_the_receivers_loop(loop: asyncio.AbstractEventLoop,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX progress calls made in half a second with no endpoint and with 16 idle ones: the same few
    (the watchdog's), not one more round per endpoint. The call is wrapped to count it, and made as before."""
    calls = [0]
    progress = ucx._Progress._progress

    def counted(self: ucx._Progress) -> None:
        calls[0] += 1
        progress(self)

    monkeypatch.setattr(ucx._Progress, "_progress", counted)
    receiver = ucx.UCXReceiver(timeout_s=TIMEOUT_S, shared_memory=False, max_endpoints=32,
                               handshake_timeout_s=60, idle_timeout_s=60)

    async def rate() -> int:
        await asyncio.sleep(0.1)
        before = calls[0]
        await asyncio.sleep(0.5)
        return calls[0] - before

    async def body() -> tuple[int, int]:
        await receiver.start()
        alone = await rate()
        endpoints = await silent(receiver.address, 16)
        await until(lambda: len(receiver._links) == 16, 2.0)  # noqa: SLF001
        crowded = await rate()
        for endpoint in endpoints:
            endpoint.abort()
        await receiver.close()
        return alone, crowded

    alone, crowded = run(loop, body())
    assert crowded <= 2 * alone + 10, (alone, crowded)
