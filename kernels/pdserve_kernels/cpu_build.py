"""Compiling the CPU kernels (`kernels/pdserve_kernels/cpu_*.c`) at first use and loading them through ctypes.

Each source is compiled with the machine's C compiler (`$CC`, else `cc`) for a target CPU
(`-march=native` by default: AVX-512 code where the CPU has it, AVX2 or plain C elsewhere, chosen by
the compiler's own feature macros), into a cache directory keyed by the source, the flags and the
CPU's flags, so each machine builds each kernel once. Where no compiler works, `load` gives None and
callers keep their torch path. `march` other than "native" builds for another CPU (the tests build
for an AVX2-only one, `x86-64-v3`, to check the fallback code on a machine with AVX-512).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def flags(march: str) -> tuple[str, ...]:
    return ("-O3", f"-march={march}", "-fopenmp", "-fPIC", "-shared")


def cpu_flags() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith("flags")), "")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "pdserve" / "kernels"


def _build(compiler: str, source: Path, march: str) -> Path:
    """The shared library for this source, flags and CPU, compiled if not cached yet. Written under a
    temporary name and renamed, so processes building at once never load a half-written file."""
    options = flags(march)
    # The headers next to it are part of what it compiles (`#include "cpu_common.h"`).
    code = source.read_bytes() + b"".join(header.read_bytes() for header in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(code + " ".join(options).encode() + cpu_flags().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *options, "-o", str(built), str(source), "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(built, target)
    return target


@functools.cache
def load(source: Path, march: str = "native") -> ctypes.CDLL | None:
    """The compiled kernel library, or None where it cannot be built here (logged once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: %s stays on the torch path", source.name)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, source, march)))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("building %s failed (%s): the torch path is used", source.name, error)
        return None
