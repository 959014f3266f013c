"""Shared pieces of the benchmarks: machine description, result files, timers, stub prefill, tables."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from cluster.engine.llm_engine import LLMEngine

RESULTS = Path(__file__).resolve().parent / "results"
console = Console(width=150)  # wide tables also when piped to a log


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(module: str = "benchmarks.engine") -> dict[str, Any]:
    """What the numbers were measured on (the load average tells how noisy the machine was), and the
    command that reproduces them (`python -m <module> <this run's arguments>`)."""
    import transformers

    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
        "python": platform.python_version(), "load_average_at_start": os.getloadavg(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": f"python -m {module} " + shlex.join(sys.argv[1:]),
        "git": git_state(),
    }


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
    path = RESULTS / f"{name}.json"
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


class Timers:
    """Seconds spent per named section, accumulated; wraps callables so the engine's own call sites
    are timed in place (a perf_counter pair per call, a few hundred nanoseconds)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start

        return timed

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The totals so far, then zero."""
        totals = dict(self.totals)
        self.totals.clear()
        return totals


def fake_tokens(count: int, rng: np.random.Generator) -> list[int]:
    # Ordinary vocabulary ids, as synthetic_workload uses: no special tokens.
    return rng.integers(1000, 30000, count).tolist()


def stub_prefill(engine: LLMEngine, rng: np.random.Generator) -> int:
    """Advance every queued request to steady decode without a forward pass: the scheduler admits
    and 'computes' prompts, sampled tokens are made up. KV slots keep their zeros, which changes no
    timing: every op of a decode step costs the same whatever the values. Returns the steps taken."""
    scheduler, steps = engine.scheduler, 0
    while scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
        output = scheduler.schedule()
        sampled = {s.request.request_id: token for s, token in
                   zip(output.scheduled, fake_tokens(len(output.scheduled), rng), strict=True) if s.samples}
        scheduler.update_from_output(output, sampled)
        steps += 1
    return steps
