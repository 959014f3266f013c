"""What one tenant can do to another through a shared gateway: two attacks, measured on `pdserve
serve --local` (the default model) with two API keys, an attacker's and a victim's.

    python -m benchmarks.tenant_attacks                  # both attacks
    python -m benchmarks.tenant_attacks --attack flood   # or: schemas

- flood: the attacker, limited to 1 request per second, keeps `--flood` requests of a 1 MiB prompt
  (just under max_prompt_bytes) in flight; the victim meanwhile sends small requests one after
  another. Reported: the victim's latency (median, p95, max) and errors with the flood and without
  it (the baseline, in the same run), and the attacker's answers by status.
- schemas: the attacker sends `--schemas` requests, each with a distinct JSON schema of about
  60 KB (just under max_grammar_bytes) and one token to generate. Reported: the server process's
  RSS growth, and the victim's latency afterwards.

The server runs in its own process (its RSS is the gateway's and the engine's: `--local` serves both
from one process); the clients in this one. Writes benchmarks/results/tenant-attacks.<machine>.<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import string
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import psutil

from benchmarks.common import machine, print_table, save

ATTACKER, VICTIM = "sk-attacker", "sk-victim"
KEYS = {"keys": [{"name": "attacker", "key": ATTACKER, "rate_limit_rps": 1},
                 {"name": "victim", "key": VICTIM}]}
VICTIM_BODY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def random_words(nbytes: int, seed: int) -> str:
    """Text of distinct random words: the tokenizer's word cache makes repeated text cheap."""
    generator = random.Random(seed)
    return " ".join("".join(generator.choices(string.ascii_lowercase, k=7)) for _ in range(nbytes // 8))


def padded_schema(index: int, properties: int = 1900) -> dict[str, Any]:
    """A distinct JSON schema of many properties (about 60 KB at 1,900)."""
    return {"type": "object", "properties": {f"p{index}_{j:05d}": {"type": "string"} for j in range(properties)}}


class Server:
    """`pdserve serve --local` in a child process, with the two keys."""

    def __init__(self, model: str) -> None:
        self.port = free_port()
        self.keys = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)  # noqa: SIM115
        json.dump(KEYS, self.keys)
        self.keys.close()
        command = [sys.executable, "-m", "cluster.cli", "serve", "--local", "--model", model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--grpc-port", "-1", "--api-keys-file", self.keys.name]
        self.process = subprocess.Popen(command, env=os.environ.copy())
        self.url = f"http://127.0.0.1:{self.port}"

    async def ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=5) as client:
            while time.monotonic() < deadline:
                try:
                    if (await client.get(self.url + "/ready")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise TimeoutError("the server did not become ready")

    def rss_mb(self) -> float:
        return float(psutil.Process(self.process.pid).memory_info().rss) / 2**20

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        os.unlink(self.keys.name)


async def victim_latencies(url: str, count: int) -> dict[str, Any]:
    """`count` small requests, one after another: latencies of those answered, statuses of all."""
    latencies, statuses = [], []
    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {VICTIM}"}) as client:
        for _ in range(count):
            started = time.perf_counter()
            response = await client.post("/v1/completions", json=VICTIM_BODY)
            statuses.append(response.status_code)
            if response.status_code == 200:
                latencies.append(time.perf_counter() - started)
    ordered = sorted(latencies) or [float("nan")]
    return {"answered": len(latencies), "errors": {str(s): statuses.count(s) for s in set(statuses) if s != 200},
            "median_s": ordered[len(ordered) // 2], "p95_s": ordered[int(0.95 * (len(ordered) - 1))],
            "max_s": ordered[-1]}


async def flood(url: str, in_flight: int, stop: asyncio.Event) -> dict[str, int]:
    """Keep `in_flight` 1 MiB-prompt requests of the attacker open until `stop`; statuses counted."""
    prompts = [random_words((1 << 20) - 64, seed) for seed in range(in_flight)]
    statuses: dict[str, int] = {}

    async def one(client: httpx.AsyncClient, prompt: str) -> None:
        while not stop.is_set():
            try:
                response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                status = str(response.status_code)
            except httpx.HTTPError as error:
                status = type(error).__name__
            statuses[status] = statuses.get(status, 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {ATTACKER}"},
                                 limits=httpx.Limits(max_connections=in_flight + 4)) as client:
        await asyncio.gather(*(one(client, prompt) for prompt in prompts))
    return statuses


async def flood_attack(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    baseline = await victim_latencies(server.url, args.victim_requests)
    stop = asyncio.Event()
    attacker = asyncio.create_task(flood(server.url, args.flood, stop))
    await asyncio.sleep(2)  # the flood builds up
    attacked = await victim_latencies(server.url, args.victim_requests)
    stop.set()
    return {"baseline": baseline, "attacked": attacked, "attacker_statuses": await attacker,
            "flood_in_flight": args.flood}


async def schema_attack(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    before = server.rss_mb()
    statuses: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                 headers={"Authorization": f"Bearer {VICTIM}"}) as client:  # no rate limit
        for index in range(args.schemas):
            body = {"prompt": "Fill the form:", "max_tokens": 1, "guided_json": padded_schema(index)}
            status = str((await client.post("/v1/completions", json=body)).status_code)
            statuses[status] = statuses.get(status, 0) + 1
    after = server.rss_mb()
    return {"schemas": args.schemas, "schema_bytes": len(json.dumps(padded_schema(0))), "statuses": statuses,
            "rss_before_mb": before, "rss_after_mb": after, "rss_growth_mb": after - before,
            "victim_after": await victim_latencies(server.url, args.victim_requests)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for attack, measure in (("flood", flood_attack), ("schemas", schema_attack)):
        if args.attack not in ("all", attack):
            continue
        server = Server(args.model)  # a fresh server per attack: one's memory does not hide the other's
        try:
            await server.ready()
            await victim_latencies(server.url, 3)  # warm-up
            results[attack] = await measure(server, args)
        finally:
            server.stop()
    return results


def report(results: dict[str, Any]) -> None:
    if "flood" in results:
        rows = [[arm, r["answered"], json.dumps(r["errors"]), r["median_s"], r["p95_s"], r["max_s"]]
                for arm, r in (("no flood", results["flood"]["baseline"]), ("flood", results["flood"]["attacked"]))]
        print_table("the victim's requests", ["arm", "answered", "errors", "median s", "p95 s", "max s"], rows)
        print_table("the attacker's answers", ["status", "count"],
                    [[status, count] for status, count in sorted(results["flood"]["attacker_statuses"].items())])
    if "schemas" in results:
        s = results["schemas"]
        print_table("padded schemas", ["schemas", "bytes each", "statuses", "RSS before MB", "RSS after MB",
                                       "growth MB", "victim median s"],
                    [[s["schemas"], s["schema_bytes"], json.dumps(s["statuses"]), s["rss_before_mb"],
                      s["rss_after_mb"], s["rss_growth_mb"], s["victim_after"]["median_s"]]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attack", choices=["all", "flood", "schemas"], default="all")
    parser.add_argument("--model", default="default")
    parser.add_argument("--flood", type=int, default=16, help="the attacker's requests in flight")
    parser.add_argument("--victim-requests", type=int, default=12)
    parser.add_argument("--schemas", type=int, default=60)
    parser.add_argument("--label", default="", help="a name for this run's code (e.g. a commit), kept in the JSON")
    args = parser.parse_args(argv)
    results = asyncio.run(run(args))
    report(results)
    save("tenant-attacks", {"args": vars(args), **results}, machine("benchmarks.tenant_attacks"))


if __name__ == "__main__":
    main()
