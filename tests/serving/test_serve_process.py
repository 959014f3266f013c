"""`pdserve serve` as operators run it: a process with both front doors, `pdserve status`, SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cluster.cli import main as cli_main
from cluster.weights.synthetic import build_tiny_llama_checkpoint

START_TIMEOUT_S = 120.0


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def wait_for_url(process: subprocess.Popen[str], seen: list[str] | None = None) -> tuple[str, int]:
    """The HTTP URL and gRPC port the server printed once listening; the lines before go to `seen`."""
    assert process.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if seen is not None:
            seen.append(line)
        found = re.search(r"HTTP on (http://\S+?), gRPC on port (\d+)", line)
        if found:
            return found.group(1), int(found.group(2))
        if not line and process.poll() is not None:
            break
    pytest.fail(f"the server did not start (exit code {process.poll()})")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_serve_answers_reports_status_and_stops_on_sigterm(checkpoint: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    command = [sys.executable, "-m", "cluster.cli", "serve", "--local", "--model", str(checkpoint), "--host",
               "127.0.0.1", "--port", "0", "--grpc-port", "0", "--max-num-seqs", "8", "--tool-call-parser", "mistral",
               "--exclude-tools-when-tool-choice-none", "--kv-cache-dtype", "fp8", "--prefix-cache-isolation", "shared"]
    env = {**os.environ, "PDSERVE_API_KEY": ""}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        started: list[str] = []
        url, grpc_port = wait_for_url(process, started)
        assert any("read in the mistral format" in line for line in started), started
        assert any("tool_choice none leaves a request's tools out" in line for line in started), started
        assert any("prefix cache isolation: shared" in line for line in started), started
        assert get(url + "/health")[0] == 200
        deadline = time.monotonic() + START_TIMEOUT_S
        while get(url + "/ready")[0] != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.2)
        model = get(url + "/v1/models")[1]["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 5, "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 5
        status, workers = get(url + "/v1/workers")
        assert status == 200 and workers["ready"] and workers["workers"][0]["role"] == "colocated"
        assert workers["workers"][0]["kv_cache_dtype"] == "float8_e4m3fn"  # --kv-cache-dtype fp8 (vLLM's alias)
        monkeypatch.setenv("COLUMNS", "160")  # rich cuts cells to fit 80 columns under pytest
        assert cli_main(["status", "--url", url]) == 0
        shown = capsys.readouterr().out
        assert "local-0" in shown and "/fp8 " in shown, shown  # the weights' dtype (auto: by the CPU), the cache's
        assert grpc_port > 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_status_of_nothing_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["status", "--url", "http://127.0.0.1:9", "--timeout", "2"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_serve_on_a_missing_gpu_refuses_at_start(checkpoint: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    command = [sys.executable, "-m", "cluster.cli", "serve", "--local", "--device", "cuda", "--model", str(checkpoint),
               "--host", "127.0.0.1", "--port", "0", "--grpc-port", "-1"]
    env = {**os.environ, "PDSERVE_API_KEY": ""}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "sees no CUDA device" in result.stderr and "Traceback" not in result.stderr
