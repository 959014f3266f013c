"""A gateway killed and started again takes over the workers it left, models still loaded.

A Ray head of its own (`ray start`), a gateway (`pdserve serve --ray-address ... --name`) serving a
stream when it is killed with SIGKILL (no drain, no goodbye). Its routers die with it; its workers,
detached, do not. A second gateway of the same name finds them by name: the same worker processes
(their start times unchanged), the same answers, and the killed gateway's stream leaves no KV block
behind. `pdserve stop-workers` ends them. Every address is 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.deploy.test_multinode import (
    MAX_TOKENS,
    PROMPT,
    RAY_ENV,
    Processes,
    engine_alone,
    free_port,
    http_json,
    port_open,
    ray_start,
    wait_for_url,
    wait_until,
)


def start_gateway(processes: Processes, name: str, gcs_port: int, config: Path, checkpoint: Path,
                  env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    gateway = processes.start(name, [
        sys.executable, "-m", "cluster.cli", "serve", "--ray-address", f"127.0.0.1:{gcs_port}", "--name", "restart",
        "--config", str(config), "--model", str(checkpoint), "--host", "127.0.0.1", "--port", "0",
        "--grpc-port", "0", "--drain-s", "1"], env, stdout=subprocess.PIPE)
    url = wait_for_url(gateway, processes)
    wait_until(lambda: http_json(url + "/ready")[0] == 200, f"{name} to be ready", processes)
    return gateway, url


def completion(url: str) -> str:
    model = http_json(url + "/v1/models")[1]["data"][0]["id"]
    status, reply = http_json(url + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert status == 200, reply
    return str(reply["choices"][0]["text"])


def workers(url: str) -> dict[str, dict[str, float]]:
    return {w["worker_id"]: w for w in http_json(url + "/v1/workers")[1]["workers"]}


def stream_until_cut(url: str, streaming: threading.Event) -> None:
    """A long stream (its prompt and tokens fill the context), read until its gateway dies under it."""
    body = {"prompt": PROMPT, "max_tokens": 490, "temperature": 0, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with contextlib.suppress(Exception), urllib.request.urlopen(request, timeout=60) as response:
        for _ in response:  # cut by the kill, as meant
            streaming.set()


def test_a_killed_gateway_started_again_takes_over_its_workers(tmp_path: Path, processes: Processes,
                                                               ray_temp_dir: Path) -> None:
    checkpoint = build_tiny_llama_checkpoint(tmp_path / "tiny")
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "prefill": {"replicas": 1, "num_cpus": 0.25}, "decode": {"replicas": 1, "num_cpus": 0.25},
        "engine": {"dtype": "float32", "model": str(checkpoint), "block_size": 4, "num_blocks": 256}}))
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "PDSERVE_REDIS_URL")}
    env.update(RAY_ENV, PDSERVE_API_KEY="")
    gcs_port = free_port()
    ray_start(processes, "head", gcs_port, {}, env, ray_temp_dir, free_port())
    wait_until(lambda: port_open(gcs_port), "the head's GCS", processes)

    first, url = start_gateway(processes, "gateway-1", gcs_port, config, checkpoint, env)
    expected = engine_alone(checkpoint)
    assert completion(url) == expected
    before = workers(url)
    assert before.keys() == {"prefill-0", "decode-0"}
    streaming = threading.Event()
    reader = threading.Thread(target=stream_until_cut, args=(url, streaming), daemon=True)
    reader.start()
    assert streaming.wait(timeout=60), "the stream never started"
    os.killpg(first.pid, signal.SIGKILL)  # no drain: the gateway and its routers are gone at once
    first.wait(timeout=30)
    processes.started = [(name, process) for name, process in processes.started if process is not first]
    reader.join(timeout=30)

    started = time.monotonic()
    _, url = start_gateway(processes, "gateway-2", gcs_port, config, checkpoint, env)
    took_over_s = time.monotonic() - started
    after = workers(url)
    assert {w: after[w]["started_at"] for w in after} == {w: before[w]["started_at"] for w in before}  # not reloaded
    assert completion(url) == expected
    # The stream the killed gateway served ends on the worker (its tokens run out) and gives its blocks back.
    wait_until(lambda: all(w["running"] == 0 and w["free_blocks"] == w["blocks"] for w in workers(url).values()),
               "the killed gateway's stream to end and free its blocks", processes, timeout_s=60)
    print(f"second gateway ready in {took_over_s:.1f} s")

    stopped = subprocess.run([sys.executable, "-m", "cluster.cli", "stop-workers", "--name", "restart",
                              "--ray-address", f"127.0.0.1:{gcs_port}"], env=env, capture_output=True, text=True,
                             timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped 2 workers of restart" in stopped.stdout
