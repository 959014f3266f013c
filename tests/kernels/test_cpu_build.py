"""Building the CPU kernels at first use: the cache, and the torch path kept where no compiler works."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdserve_kernels import cpu_build, cpu_fused


def test_without_a_compiler_the_kernels_are_not_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "cpu_fused_copy.c"
    shutil.copy(cpu_fused.SOURCE, source)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_build.load(source) is None


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_a_build_is_cached_per_source_and_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "tiny.c"
    source.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    library = cpu_build.load(source)
    assert library is not None and library.answer() == 42
    built = sorted((tmp_path / "cache" / "pdserve" / "kernels").glob("tiny-*.so"))
    assert len(built) == 1
    source.write_text("int answer(void) { return 43; }\n")
    cpu_build.load.cache_clear()
    changed = cpu_build.load(source)
    assert changed is not None and changed.answer() == 43, "a changed source is rebuilt, not read from the cache"
