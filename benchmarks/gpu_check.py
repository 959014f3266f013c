"""The GPU check: everything in pdserve that needs CUDA, in one run on one GPU machine.

    python -m benchmarks.gpu_check [--minutes 8] [--skip-kernels]

1. The `gpu`-marked tests (`pytest -m gpu`): greedy tokens on CUDA equal transformers' on CUDA (torch
   and Triton attention), CUDA-graph replays equal eager steps, KV staging through pinned memory.
2. `pdserve serve --device cuda` on an embedded Ray: 1 prefill + 1 decode worker sharing the GPU
   (pools of `num_gpus: 0.5`, each worker on 0.45 of its memory), KV over UCX straight from and into
   device memory (`kv_path` says which path the workers' logs name; PDSERVE_KV_VIA_HOST=1 would stage
   through pinned host buffers); a short serving run against it with `pdserve bench --url` (TTFT, ITL,
   tokens/s), then the KV figures of /metrics (transfers, bytes, failures, recomputes: the last two
   must be 0).
3. `python -m benchmarks.kernels --quick`: the Triton kernels against the torch references, decode
   attention against the HBM copy bandwidth measured in the same run, prefill against torch's flash
   SDPA (its own JSON in benchmarks/results/).

Each step runs in a subprocess with its share of the time; the figures go to
benchmarks/results/gpu-check-<gpu>.<machine>.<date>.json with the machine. Without a CUDA device it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, console, gpu_slug, machine, result_path

ROOT = Path(__file__).resolve().parents[1]
PDSERVE = [sys.executable, "-m", "cluster.cli"]


def run_step(name: str, command: list[str], timeout_s: float, **kwargs: Any) -> dict[str, Any]:
    """A subprocess with a deadline: its exit code, seconds and the tail of its output."""
    console.print(f"[bold]{name}[/bold]: {' '.join(command)}")
    started = time.monotonic()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, **kwargs)
        code, output = result.returncode, result.stdout + result.stderr
    except subprocess.TimeoutExpired as error:
        code, output = 124, f"{error.stdout or ''}{error.stderr or ''}\ntimed out after {timeout_s:.0f} s"
    seconds = time.monotonic() - started
    console.print(f"  exit {code} in {seconds:.0f} s")
    return {"command": command, "exit_code": code, "seconds": round(seconds, 1), "tail": str(output)[-3000:]}


def gpu_tests(timeout_s: float) -> dict[str, Any]:
    step = run_step("gpu tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"], timeout_s)
    summary = re.findall(r"(\d+) (passed|failed|skipped|error)", step["tail"])
    step["counts"] = {kind: int(count) for count, kind in summary}
    return step


def metric(text: str, name: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(value) for value in pattern.findall(text))


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except Exception as error:  # not up yet, or refusing: the caller polls
        return getattr(error, "code", 0), str(error)


def serving(timeout_s: float) -> dict[str, Any]:
    """`pdserve serve --device cuda` (1 prefill + 1 decode on one GPU), a short benchmark, /metrics."""
    deadline = time.monotonic() + timeout_s
    log = Path(tempfile.mkstemp(prefix="gpu-check-serve-", suffix=".log")[1])
    env = {**os.environ, "PDSERVE_API_KEY": ""}
    shared = Path(tempfile.mkstemp(prefix="gpu-check-cluster-", suffix=".yaml")[1])
    shared.write_text(json.dumps({"prefill": {"num_gpus": 0.5}, "decode": {"num_gpus": 0.5}}))  # YAML reads JSON
    command = [*PDSERVE, "serve", "--config", str(shared), "--device", "cuda", "--num-prefill", "1", "--num-decode",
               "1", "--host", "127.0.0.1", "--port", "18000", "--grpc-port", "-1", "--drain-s", "2"]
    url = "http://127.0.0.1:18000"
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    result: dict[str, Any] = {"command": command}
    try:
        while get(url + "/ready")[0] != 200:
            if server.poll() is not None or time.monotonic() > deadline:
                result.update(error="the server never became ready", ready=get(url + "/ready"))
                return result
            time.sleep(1)
        result["ready_after_s"] = round(timeout_s - (deadline - time.monotonic()), 1)
        report = Path(tempfile.mkdtemp(prefix="gpu-check-bench-")) / "bench.json"
        bench = run_step("serving run", [*PDSERVE, "bench", "--url", url, "--num-requests", "64", "--input-len", "256",
                                         "--output-len", "64", "--max-concurrency", "16", "--json", str(report)],
                         max(30.0, deadline - time.monotonic() - 10), env=env)
        result["bench"] = {key: bench[key] for key in ("exit_code", "seconds", "tail")}
        if report.exists():
            result["bench"]["summary"] = json.loads(report.read_text()).get("summary")
        scrape = get(url + "/metrics")[1]
        result["kv"] = {name: metric(scrape, f"pdserve:{name}") for name in
                        ("kv_transfers", "kv_transfer_bytes", "kv_transfer_failures", "kv_recomputes")}
        result["workers"] = json.loads(get(url + "/v1/workers")[1]).get("workers")
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        text = log.read_text(errors="replace")
        result["kv_path"] = ("direct" if "straight from and into GPU memory" in text
                             else "host" if "through pinned host memory" in text else "not logged")
        result["log_tail"] = text[-3000:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="the whole check's budget")
    parser.add_argument("--skip-kernels", action="store_true")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        console.print("no CUDA device here: the GPU check needs one (see docs/deploy.md)")
        return 2
    budget = args.minutes * 60
    results: dict[str, Any] = {"machine": machine(), "gpu": torch.cuda.get_device_name(0)}
    results["gpu_tests"] = gpu_tests(0.3 * budget)
    results["serving"] = serving(0.35 * budget)
    if not args.skip_kernels:
        results["kernels"] = run_step("kernel benchmark", [sys.executable, "-m", "benchmarks.kernels", "--quick",
                                                           "--no-engine"], 0.3 * budget)

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(f"gpu-check-{gpu_slug(results['gpu'])}")
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    console.print(f"wrote {path}")
    kv = results["serving"].get("kv", {})
    ok = (results["gpu_tests"]["exit_code"] == 0 and kv.get("kv_transfers", 0) > 0
          and kv.get("kv_transfer_failures", 1) == 0 and kv.get("kv_recomputes", 1) == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
