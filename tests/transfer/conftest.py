"""Fixtures of the transfer tests: one event loop for the session (ucxx ties its progress to a loop),
and a connected sender/receiver pair of each implementation."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from cluster.transfer.loopback import LoopbackHub, LoopbackReceiver, LoopbackSender

T = TypeVar("T")
HAS_UCXX = importlib.util.find_spec("ucxx") is not None
# Short deadlines: the failure tests wait for them, and nothing here is slow when it works.
TIMEOUT_S = 3.0
# No test body may run longer than this: a hang fails the test instead of stalling the session.
BODY_TIMEOUT_S = 20.0


@pytest.fixture(scope="session")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    if HAS_UCXX:
        from cluster.transfer import ucx

        loop.run_until_complete(asyncio.sleep(0.05))  # aborted endpoints finish their callbacks
        ucx.reset_ucx()
    loop.close()
    asyncio.set_event_loop(None)


@dataclass
class Pair:
    """A started receiver and a sender that can reach it, plus the loop they run in."""

    kind: str
    loop: asyncio.AbstractEventLoop
    sender: Any
    receiver: Any

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, BODY_TIMEOUT_S))

    def new_receiver(self) -> Any:
        """Another receiver of the same kind, not started (for close and restart tests)."""
        if self.kind == "loopback":
            return LoopbackReceiver(self.receiver._hub, f"extra-{id(object())}")
        from cluster.transfer.ucx import UCXReceiver

        return UCXReceiver(timeout_s=TIMEOUT_S)

    def new_sender(self) -> Any:
        if self.kind == "loopback":
            return LoopbackSender(self.receiver._hub, timeout_s=TIMEOUT_S)
        from cluster.transfer.ucx import UCXSender

        return UCXSender(timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S)


def _make(kind: str) -> tuple[Any, Any]:
    if kind == "loopback":
        hub = LoopbackHub()
        return LoopbackSender(hub, timeout_s=TIMEOUT_S), LoopbackReceiver(hub, "decode-0")
    from cluster.transfer.ucx import UCXReceiver, UCXSender

    return UCXSender(timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S), UCXReceiver(timeout_s=TIMEOUT_S)


ucx_param = pytest.param("ucx", marks=pytest.mark.skipif(not HAS_UCXX, reason="ucxx is not installed "
                                                         "(pip install ucxx-cu13)"))


@pytest.fixture(params=["loopback", ucx_param])
def pair(request: pytest.FixtureRequest, loop: asyncio.AbstractEventLoop) -> Iterator[Pair]:
    sender, receiver = _make(request.param)
    loop.run_until_complete(receiver.start())
    yield Pair(request.param, loop, sender, receiver)
    loop.run_until_complete(sender.close())
    loop.run_until_complete(receiver.close())


@pytest.fixture
def ucx_pair(loop: asyncio.AbstractEventLoop) -> Iterator[Pair]:
    if not HAS_UCXX:
        pytest.skip("ucxx is not installed (pip install ucxx-cu13)")
    sender, receiver = _make("ucx")
    loop.run_until_complete(receiver.start())
    yield Pair("ucx", loop, sender, receiver)
    loop.run_until_complete(sender.close())
    loop.run_until_complete(receiver.close())
