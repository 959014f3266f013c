"""Two hosts for real: KV must cross a network link, not a shared loopback.

The test makes two Linux network namespaces joined by a veth pair (its own addresses, inside its own
namespaces, removed afterwards), starts a Ray node in each (the head with the prefill pool and the
gateway in host A, the decode pool in host B) and sends requests through the gateway from inside A.
Inside a namespace 127.0.0.1 is that namespace's own loopback: a decode worker that advertised
loopback would send the prefill worker to itself, the transfer would fail and the decode worker
would recompute the prompt, with the right tokens all the same. So besides the tokens (equal to the
engine alone), the test reads /metrics: KV bytes sent, no failed transfer, no recompute; and the
veth's own counters: the bytes did cross the link.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.deploy.test_multinode import RAY, RAY_ENV, Processes, free_port, wait_for_url, wait_until
from tests.helpers import fp32_model

# Addresses that exist only on the veth pair this test makes, inside its own namespaces.
HOST_A, HOST_B, PREFIX_LENGTH = "10.213.7.1", "10.213.7.2", 30
BLOCK_SIZE = 4
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(21 + 6 * i)] for i in range(4)]  # several blocks each
MAX_TOKENS = 8

# Runs inside host A: the HTTP calls the test makes of the gateway (stdlib only, so it starts fast).
CLIENT = textwrap.dedent("""
    import json, sys, urllib.error, urllib.request
    url, path, body = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else ""
    request = urllib.request.Request(url + path, body.encode() or None, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    except OSError as error:
        status, text = 0, str(error)
    print(json.dumps({"status": status, "text": text}))
""")


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    interface: str

    def run(self, command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.namespace, *command], capture_output=True, text=True,
                              **kwargs)

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]

    def rx_bytes(self) -> int:
        return int(self.run(["cat", f"/sys/class/net/{self.interface}/statistics/rx_bytes"], check=True).stdout)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise OSError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two network namespaces joined by a veth pair; removed (with the pair) afterwards."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = f"{os.getpid() % 100000}"
    a = Host(f"pdserve-a-{tag}", HOST_A, f"pdva{tag}")
    b = Host(f"pdserve-b-{tag}", HOST_B, f"pdvb{tag}")
    made: list[str] = []
    try:
        for host in (a, b):
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
        _ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
        for host in (a, b):
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/{PREFIX_LENGTH}", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
    except OSError as error:
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        pytest.skip(f"the kernel refused a network namespace or veth pair here: {error}")
    try:
        yield a, b
    finally:
        for namespace in made:  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def call(host: Host, client: Path, url: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    result = host.run([sys.executable, str(client), url, path, json.dumps(body) if body else ""], timeout=90)
    reply = json.loads(result.stdout or '{"status": 0, "text": ""}')
    return reply["status"], reply["text"]


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples over every label set."""
    pattern = re.compile(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? (\S+)$", re.M)
    return sum(float(value) for value in pattern.findall(text))


def engine_alone(checkpoint: Path) -> list[str]:
    engine = LLMEngine(EngineConfig(model=fp32_model(checkpoint),
                                    cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=128)))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [output.text for output in engine.generate(PROMPTS, params)]


def start_cluster(a: Host, b: Host, processes: Processes, tmp_path: Path, checkpoint: Path) -> str:
    """Ray head (prefill pool) and the gateway in host A, a Ray node (decode pool) in host B; the URL."""
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "mode": "disaggregated",
        "prefill": {"replicas": 1, "num_cpus": 0.25, "resources": {"prefill_node": 1}},
        "decode": {"replicas": 1, "num_cpus": 0.25, "resources": {"decode_node": 1}},
        "engine": {"dtype": "float32", "model": str(checkpoint), "block_size": BLOCK_SIZE, "num_blocks": 128}}))
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "PDSERVE_REDIS_URL")}
    env.update(RAY_ENV, PDSERVE_API_KEY="")
    gcs_port = free_port()  # any port is free in a namespace of our own
    temp_dir = Path(tempfile.mkdtemp(prefix="pd2h-", dir="/tmp"))  # short: Ray's socket paths
    common = ["--block", "--num-cpus", "1", "--num-gpus", "0", "--disable-usage-stats"]  # CPU nodes, on any host
    processes.start("head", a.exec_prefix() + [RAY, "start", *common, "--head", "--node-ip-address", a.address,
                                               "--port", str(gcs_port), "--temp-dir", str(temp_dir),
                                               "--include-dashboard", "false",
                                               "--resources", json.dumps({"prefill_node": 4})], env)
    processes.start("node-b", b.exec_prefix() + [RAY, "start", *common, "--address", f"{a.address}:{gcs_port}",
                                                 "--node-ip-address", b.address,
                                                 "--resources", json.dumps({"decode_node": 4})], env)
    serve = processes.start("serve", a.exec_prefix() + [
        sys.executable, "-m", "cluster.cli", "serve", "--ray-address", f"{a.address}:{gcs_port}",
        "--config", str(config), "--model", str(checkpoint), "--host", "127.0.0.1", "--port", "0",
        "--grpc-port", "0", "--drain-s", "2"], env, stdout=subprocess.PIPE)
    return str(wait_for_url(serve, processes))


def test_kv_crosses_the_link_between_two_hosts(tmp_path: Path, two_hosts: tuple[Host, Host],
                                               processes: Processes) -> None:
    a, b = two_hosts
    checkpoint = build_tiny_llama_checkpoint(tmp_path / "tiny")
    client = tmp_path / "client.py"
    client.write_text(CLIENT)
    url = start_cluster(a, b, processes, tmp_path, checkpoint)
    expected = engine_alone(checkpoint)  # while the workers load
    wait_until(lambda: call(a, client, url, "/ready")[0] == 200, "the gateway to be ready", processes)
    received_before = b.rx_bytes()

    model = json.loads(call(a, client, url, "/v1/models")[1])["data"][0]["id"]
    for prompt, text in zip(PROMPTS, expected, strict=True):
        status, reply = call(a, client, url, "/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert status == 200, reply
        assert json.loads(reply)["choices"][0]["text"] == text

    scrape = call(a, client, url, "/metrics")[1]
    sent = metric(scrape, "pdserve:kv_transfer_bytes")
    assert metric(scrape, "pdserve:kv_transfers") == len(PROMPTS), scrape
    assert metric(scrape, "pdserve:kv_transfer_failures") == 0, processes.log("serve")
    assert metric(scrape, "pdserve:kv_recomputes") == 0, processes.log("serve")
    assert sent > 0
    assert b.rx_bytes() - received_before >= sent  # the KV came over the veth, into host B
    with contextlib.suppress(Exception):
        print(f"two hosts: {len(PROMPTS)} requests, {sent:.0f} KV bytes over the link, 0 failed, 0 recomputed")
