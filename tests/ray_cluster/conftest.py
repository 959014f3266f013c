from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One private local Ray for the whole test session (it takes seconds to start)."""
    import ray

    from cluster.ray_cluster.launcher import init_ray

    init_ray()
    yield
    ray.shutdown()
