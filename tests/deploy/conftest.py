"""Fixtures of the tests that start processes of their own (Ray nodes, gateways)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.test_multinode import Processes


@pytest.fixture
def processes() -> Iterator[Processes]:
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-mn-logs-"))
    started = Processes(log_dir)
    try:
        yield started
    finally:
        started.stop_all()
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.fixture
def ray_temp_dir() -> Iterator[Path]:
    # Short: Ray's unix sockets live under it and their paths must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="pdmn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
