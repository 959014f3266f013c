"""The malloc settings a worker's process starts with (what they save is measured by
benchmarks/malloc_arenas.py; that the workers get them, in tests/ray_cluster/test_ray_cluster.py)."""

from __future__ import annotations

import pytest

from cluster.worker.malloc_env import ENGINE_PROCESS_ENV, engine_process_env


def test_the_engine_process_keeps_one_arena_never_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENGINE_PROCESS_ENV:
        monkeypatch.delenv(name, raising=False)
    env = engine_process_env()
    assert env["MALLOC_ARENA_MAX"] == "1"
    assert int(env["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 30
    assert int(env["MALLOC_MMAP_THRESHOLD_"]) == 32 << 20  # glibc refuses more than 32 MiB on 64-bit


def test_an_operators_own_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert engine_process_env()["MALLOC_ARENA_MAX"] == "4"
