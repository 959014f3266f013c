"""Where the test session runs Triton's kernels in its interpreter: only where no CUDA device is usable,
decided once for the whole pytest process (tests/conftest.py), so that `gpu` tests get compiled kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.triton_mode import interpret_triton

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("cuda_usable", "asked", "expected"), [
    (False, None, True),  # a CPU machine (CI): the kernels run interpreted on CPU tensors
    (True, None, False),  # a GPU machine: compiled kernels, CUDA graphs capture
    (True, "1", True),  # asked for in the environment: kept (the gpu tests are then skipped)
    (False, "0", False),
    (True, "", False),
])
def test_interpreter_only_without_a_usable_cuda_device(cuda_usable: bool, asked: str | None, expected: bool) -> None:
    assert interpret_triton(cuda_usable, asked) is expected


def test_a_session_without_cuda_interprets_the_kernels() -> None:
    """What CI runs: CUDA reported unavailable, no TRITON_INTERPRET given; the interpreter-only test runs."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    test = "tests/kernels/test_triton_kernels.py::test_auto_backend_on_cpu_is_torch"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "1 passed" in result.stdout, result.stdout + result.stderr
