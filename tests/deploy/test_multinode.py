"""A multi-node run on one machine, as the Helm chart lays it out on several hosts.

Two Ray nodes, each its own `ray start` process: the head offers the custom resource `prefill_node`,
a second node `decode_node`. `pdserve serve --ray-address` joins them with a cluster YAML that pins
each pool to its resource, the way the chart's ConfigMap pins pools to worker groups. One greedy
request through the gateway must answer as the engine alone does, and Ray's state API must show the
prefill actor on the head and the decode actor on the other node.

Only the processes started here are stopped (never `ray stop`: it ends every Ray on the machine,
the test session's own included). Every address is 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 90.0
STOP_GRACE_S = 15.0
PROMPT = [5, 17, 42, 99, 123, 7, 250, 31, 64, 12, 200, 3, 77]
MAX_TOKENS = 12
# Ray 2.60 writes an auth token under $HOME unless told not to; a SIGTERMed node would otherwise
# wait to drain; usage stats would try the network.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
           "RAY_USAGE_STATS_ENABLED": "0", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Processes:
    """Processes started in sessions of their own, stopped in reverse order: SIGTERM, then SIGKILL
    to the whole process group (a Ray node's raylet, GCS and workers are in its group)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[tuple[str, subprocess.Popen[str]]] = []
        self.logs: list[Any] = []

    def start(self, name: str, command: list[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen[str]:
        if "stdout" not in kwargs:
            kwargs["stdout"] = (self.log_dir / f"{name}.log").open("w")
            self.logs.append(kwargs["stdout"])
        process = subprocess.Popen(command, env=env, text=True, start_new_session=True,
                                   stderr=subprocess.STDOUT, **kwargs)
        self.started.append((name, process))
        return process

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop_all(self) -> None:
        for _, process in reversed(self.started):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_GRACE_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # leftovers of the group, if any
            process.wait(timeout=10)
        for log in self.logs:
            log.close()


def ray_start(processes: Processes, name: str, gcs_port: int, resources: dict[str, int], env: dict[str, str],
              head_temp_dir: Path | None = None, dashboard_port: int = 0) -> None:
    """`ray start --block` for one node; the head when `head_temp_dir` is given."""
    # No GPUs: the nodes of a test are CPU nodes even on a GPU host (--device auto then means the CPU).
    command = [RAY, "start", "--block", "--num-cpus", "1", "--num-gpus", "0", "--resources", json.dumps(resources),
               "--node-ip-address", "127.0.0.1", "--dashboard-agent-listen-port", str(free_port()),
               "--disable-usage-stats"]
    if head_temp_dir is not None:
        command += ["--head", "--port", str(gcs_port), "--temp-dir", str(head_temp_dir),
                    "--ray-client-server-port", str(free_port()), "--include-dashboard", "true",
                    "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port)]
    else:
        command += ["--address", f"127.0.0.1:{gcs_port}"]
    processes.start(name, command, env)


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 30) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def wait_until(condition: Any, what: str, processes: Processes, timeout_s: float = START_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        for name, process in processes.started:
            if process.poll() is not None:
                pytest.fail(f"{name} exited ({process.returncode}) while waiting for {what}:\n{processes.log(name)}")
        time.sleep(0.5)
    logs = "\n".join(f"--- {name}\n{processes.log(name)}" for name, _ in processes.started)
    pytest.fail(f"timed out waiting for {what}\n{logs}")


def two_nodes(dashboard: str) -> list[Any]:
    """The cluster's live nodes once there are two (none while the dashboard does not answer)."""
    from ray.util.state import list_nodes

    with contextlib.suppress(Exception):
        nodes = [node for node in list_nodes(address=dashboard, raise_on_missing_output=False)
                 if node.state == "ALIVE"]
        return nodes if len(nodes) == 2 else []
    return []


def wait_for_url(process: subprocess.Popen[str], processes: Processes) -> str:
    """The HTTP URL `pdserve serve` prints once it listens. Its output goes on into its log, read by
    a thread, so that a full pipe never blocks it."""
    assert process.stdout is not None
    stdout = process.stdout
    found: queue.Queue[str] = queue.Queue()

    def copy_to_log() -> None:
        with (processes.log_dir / "serve.log").open("w") as log:
            for line in stdout:
                log.write(line)
                log.flush()
                url = re.search(r"HTTP on (http://\S+?),", line)
                if url:
                    found.put(url.group(1))

    threading.Thread(target=copy_to_log, daemon=True).start()
    return wait_until(lambda: found.get_nowait() if not found.empty() else None, "pdserve serve to listen",
                      processes)


def engine_alone(checkpoint: Path) -> str:
    engine = LLMEngine(EngineConfig(model=fp32_model(checkpoint),
                                    cache=CacheConfig(block_size=4, num_blocks=128)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return engine.generate([PROMPT], params)[0].text


def test_pools_on_their_own_nodes_answer_as_the_engine_alone(tmp_path: Path, processes: Processes,
                                                            ray_temp_dir: Path) -> None:
    checkpoint = build_tiny_llama_checkpoint(tmp_path / "tiny")
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "mode": "disaggregated",
        "prefill": {"replicas": 1, "num_cpus": 0.25, "resources": {"prefill_node": 1}},
        "decode": {"replicas": 1, "num_cpus": 0.25, "resources": {"decode_node": 1}},
        "engine": {"dtype": "float32", "model": str(checkpoint), "block_size": 4, "num_blocks": 128}}))
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "PDSERVE_REDIS_URL")}
    env.update(RAY_ENV, PDSERVE_API_KEY="")
    gcs_port, dashboard_port = free_port(), free_port()
    dashboard = f"http://127.0.0.1:{dashboard_port}"

    ray_start(processes, "head", gcs_port, {"prefill_node": 4}, env, ray_temp_dir, dashboard_port)
    wait_until(lambda: port_open(gcs_port), "the head's GCS", processes)
    # The second node and the gateway start together: the pools' actors wait for their nodes.
    ray_start(processes, "node2", gcs_port, {"decode_node": 4}, env)
    serve = processes.start("serve", [
        sys.executable, "-m", "cluster.cli", "serve", "--ray-address", f"127.0.0.1:{gcs_port}",
        "--config", str(config), "--model", str(checkpoint), "--host", "127.0.0.1", "--port", "0",
        "--grpc-port", "0", "--drain-s", "2"], env, stdout=subprocess.PIPE)
    url = wait_for_url(serve, processes)
    expected = engine_alone(checkpoint)  # while the workers load
    wait_until(lambda: http_json(url + "/ready")[0] == 200, "the gateway to be ready", processes)

    nodes = wait_until(lambda: two_nodes(dashboard), "both nodes in Ray's state API", processes)
    node_of_resource = {name: node.node_id for node in nodes for name in node.resources_total
                        if name in ("prefill_node", "decode_node")}
    assert node_of_resource.keys() == {"prefill_node", "decode_node"}
    assert node_of_resource["prefill_node"] != node_of_resource["decode_node"]

    model = http_json(url + "/v1/models")[1]["data"][0]["id"]
    status, reply = http_json(url + "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert status == 200, reply
    assert reply["choices"][0]["text"] == expected
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS

    workers = {w["role"]: w for w in http_json(url + "/v1/workers")[1]["workers"]}
    assert workers.keys() == {"prefill", "decode"}
    placed = actor_nodes(dashboard)
    assert placed["prefill"] == node_of_resource["prefill_node"], placed
    assert placed["decode"] == node_of_resource["decode_node"], placed


def actor_nodes(dashboard: str) -> dict[str, str]:
    """Role -> node id of the live worker actors, named pdserve-<cluster>-<role>-<index>."""
    from ray.util.state import list_actors

    placed: dict[str, str] = {}
    for actor in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], detail=True,
                             raise_on_missing_output=False):
        found = re.fullmatch(r"pdserve-\w+-(prefill|decode)-\d+", actor.name or "")
        if found:
            placed[found.group(1)] = actor.node_id
    return placed
