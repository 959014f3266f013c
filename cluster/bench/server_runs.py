"""The server under test: `pdserve serve` in a subprocess, driven over HTTP by `cluster.bench.serving`.

`running_server` starts one per `ServerSettings` (one local engine, or the Ray cluster) with the
engine's torch threads set through OMP_NUM_THREADS, logging to a temporary file, and yields its URL
once it listens; `measure` runs one benchmark against it and returns the summary (and one per
request class) as plain data. The benchmark client runs in the calling process.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from cluster.bench.serving import HttpDriver, LoadConfig, benchmark
from cluster.bench.workloads import WorkloadConfig

START_TIMEOUT_S = 600.0  # a cold Ray cluster on a busy machine takes minutes
console = Console()


@dataclass(frozen=True, slots=True)
class ServerSettings:
    model: str = "default"
    threads: int = 1
    cluster: bool = False  # the Ray cluster (1 prefill + 1 decode worker) instead of one local engine
    colocated: bool = False  # with `cluster`: one colocated worker instead
    max_num_batched_tokens: int = 2048
    kv_cache_memory_gb: float = 1.0
    config: str = ""  # a cluster YAML file (`--config`)

    def command(self) -> list[str]:
        backend = ["--num-prefill", "1", "--num-decode", "1"] if self.cluster else ["--local"]
        if self.cluster and self.colocated:
            backend = ["--mode", "colocated", "--num-decode", "1"]
        if self.config:
            backend += ["--config", self.config]
        return [sys.executable, "-m", "cluster.cli", "serve", *backend, "--model", self.model,
                "--host", "127.0.0.1", "--port", "0", "--grpc-port", "-1", "--log-level", "warning",
                "--drain-s", "2", "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--kv-cache-memory-gb", str(self.kv_cache_memory_gb)]


@contextmanager
def running_server(settings: ServerSettings) -> Iterator[str]:
    """`pdserve serve` in a subprocess, logging to a temporary file; yields its URL once it listens
    (the benchmark then waits for /ready); SIGTERM at the end."""
    env = {**os.environ, "PDSERVE_API_KEY": ""}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # threads 0: the workers' own choice (they follow the load)
        env.pop(name, None)
        if settings.threads > 0:
            env[name] = str(settings.threads)
    with tempfile.NamedTemporaryFile("w+", prefix="pdserve-bench-", suffix=".log") as log:
        process = subprocess.Popen(settings.command(), stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            yield _wait_for_url(process, Path(log.name))
        finally:
            _stop(process)


def _wait_for_url(process: subprocess.Popen[str], log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.search(r"HTTP on (http://[^\s,;]+)", log.read_text())
        if found:
            return found.group(1)
        if process.poll() is not None:
            break
        time.sleep(0.2)
    tail = "\n".join(log.read_text().splitlines()[-20:])
    raise RuntimeError(f"the server did not start (exit code {process.poll()}):\n{tail}")


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure(url: str, workload: WorkloadConfig, load: LoadConfig) -> dict[str, Any]:
    """One benchmark run; its summary (and one per request class) as plain data."""
    run = asyncio.run(benchmark(HttpDriver(url), workload, replace(load, ready_timeout_s=START_TIMEOUT_S), console))
    point: dict[str, Any] = {"load_average": run.load_average, **run.summary().as_dict()}
    if len(run.tags) > 1:
        point["by_tag"] = {tag: run.summary(tag=tag).as_dict() for tag in run.tags}
    return point
