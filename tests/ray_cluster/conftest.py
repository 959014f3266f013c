from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_session(request: pytest.FixtureRequest) -> Iterator[None]:
    """One private local Ray for the whole test session (it takes seconds to start). Its temporary
    directory goes with it, unless a test failed (Ray's logs are there)."""
    from cluster.ray_cluster.launcher import init_ray, shutdown_ray

    init_ray()
    yield
    shutdown_ray(keep_logs=request.session.testsfailed > 0)


def pace_steps(pause_s: float) -> Callable[[Any], None]:
    """For `actor.__ray_call__`: inside a worker actor, make each engine step wait `pause_s` (a larger
    model's step, so a test is about the order of events) and count the steps (`actor.steps`)."""

    def pace(actor: Any) -> None:
        import time

        engine = actor.worker.engine
        step, actor.steps = engine.step, 0

        def paced() -> Any:
            time.sleep(pause_s)
            actor.steps += 1
            return step()

        engine.step = paced

    return pace


def wait_for(condition: Callable[[], Any], what: str, within_s: float = 60) -> None:
    """Poll `condition` every 0.2 s until it holds; fail with `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
