"""Shared pieces of the benchmarks: machine description, result files, timers, stub prefill, tables."""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"
console = Console(width=150)  # wide tables also when piped to a log


# The widest SIMD a CPU has, best first, by the /proc/cpuinfo flag that shows it: what decides which
# dtype and kernels run, so what a figure moves with most.
SIMD_LEVELS = (("amx", "amx_bf16"), ("avx512bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2"),
               ("sve", "sve"), ("neon", "asimd"))
# Words of a model name that name a line of CPUs; a CPU named by none goes by its vendor.
CPU_LINES = ("epyc", "xeon", "threadripper", "ryzen", "core", "graviton")
VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}


@dataclass(frozen=True, slots=True)
class Cpu:
    """The CPU a figure was measured on, as /proc/cpuinfo (lscpu's source) describes it."""

    model: str
    vendor: str
    flags: frozenset[str]
    cores: int

    @classmethod
    def here(cls) -> Cpu:
        fields: dict[str, str] = {}
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first processor's
        except OSError:
            pass
        flags = fields.get("flags") or fields.get("Features") or ""  # x86 / Arm
        return cls(model=fields.get("model name") or platform.processor() or "unknown",
                   vendor=fields.get("vendor_id", ""), flags=frozenset(flags.split()), cores=os.cpu_count() or 1)


def cpu_model() -> str:
    return Cpu.here().model


def machine_slug(cpu: Cpu) -> str:
    """The machine in a result file's name: the CPU's line (or its vendor), its widest SIMD level and
    its core count, e.g. `epyc-avx512bf16-2c`, `xeon-amx-2c`."""
    words = re.findall(r"[a-z0-9]+", cpu.model.lower())
    line = next((name for name in CPU_LINES if name in words), None)
    line = line or VENDORS.get(cpu.vendor) or re.sub(r"[^a-z0-9]", "", platform.machine().lower()) or "cpu"
    level = next((name for name, flag in SIMD_LEVELS if flag in cpu.flags), None)
    return "-".join(part for part in (line, level, f"{cpu.cores}c") if part)


@functools.cache
def run_date() -> datetime.date:
    """The UTC day of this run's first result file: every file of a run carries it, past midnight too."""
    return datetime.datetime.now(datetime.UTC).date()


def result_name(benchmark: str, machine_name: str, day: datetime.date, suffix: str = ".json") -> str:
    return f"{benchmark}.{machine_name}.{day.isoformat()}{suffix}"


def result_path(benchmark: str, suffix: str = ".json") -> Path:
    """Where a run's file goes: `benchmarks/results/<benchmark>.<machine>.<date><suffix>`, for example
    `step-vs-linear.epyc-avx512bf16-2c.2026-12-03.json`. A later run of the same benchmark on the same
    kind of machine the same day replaces it; earlier ones live in git history."""
    return RESULTS / result_name(benchmark, machine_slug(Cpu.here()), run_date(), suffix)


def png_path(benchmark: str) -> Path:
    """A figure's path, beside its JSON results."""
    return result_path(benchmark, ".png")


def machine(module: str = "benchmarks.engine") -> dict[str, Any]:
    """What the numbers were measured on (the load average tells how noisy the machine was), and the
    command that reproduces them (`python -m <module> <this run's arguments>`)."""
    import transformers

    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "slug": machine_slug(Cpu.here()), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
        "python": platform.python_version(), "load_average_at_start": os.getloadavg(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python -m {module} " + shlex.join(sys.argv[1:]),
        "git": git_state(),
    }


def gpu_slug(gpu: str) -> str:
    """A GPU's name as it goes into result file names (`kernels-<slug>`, `gpu-check-<slug>`)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-")


def git_state() -> str:
    """The commit measured, marked dirty when cluster/ or kernels/ had uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "cluster", "kernels"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", "cluster", "kernels"], cwd=root, capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    # A digest of the uncommitted diff tells two dirty trees apart.
    return head + (f"+dirty.{hashlib.sha1(diff).hexdigest()[:8]}" if dirty else "")


def save(name: str, data: dict[str, Any], info: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(name)
    path.write_text(json.dumps({"benchmark": name, "machine": info, **data}, indent=2, default=float) + "\n")
    console.print(f"[green]wrote {path.relative_to(RESULTS.parent.parent)}")
    return path


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(f"{cell:.4g}" if isinstance(cell, float) else str(cell) for cell in row))
    console.print(table)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0
