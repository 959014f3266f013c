"""KV transfer between two processes: GB/s per payload size over UCX, against a memcpy of the same bytes.

    python -m benchmarks.kv_transfer [--sizes-mib 1 4 16 64] [--repeats 7] [--arms tcp tcp-poll1 sm]

Each arm starts a fresh receiver process and a fresh sender process (UCX reads its settings once per
process). The sender times `send` (it returns once the receiver acked that the payload landed) for
each size, one warm-up then `--repeats` timed transfers, and the median is reported. The receiver
measures how long its event loop stalls (the longest gap between 1 ms ticks) while payloads arrive,
and checks the last payload of each size bit for bit.

Arms:
- tcp: the connector (`cluster.transfer.ucx`), listener endpoints with error handling: TCP.
- tcp-poll1: the same with UCX_TCP_MAX_POLL=1 (UCX drains a socket less greedily per progress call).
- sm: raw ucxx with worker-address endpoints, error handling off and UCX_TLS=sm,self (shared memory,
  see docs/performance.md, "UCX's transports here"): the same four messages per transfer as the connector's wire
  format, minus the payload size probe, awaited the same way (`cluster.transfer.ucx.complete`). Not
  part of the connector: a dead peer hangs it, so every operation here runs under a deadline.
Results go to benchmarks/results/kv-transfer.json and kv-transfer.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cluster.transfer.connector import KVHeader

ROOT = Path(__file__).resolve().parent.parent
ARMS: dict[str, dict[str, str]] = {
    "tcp": {},
    "tcp-poll1": {"UCX_TCP_MAX_POLL": "1"},
    "sm": {"UCX_TLS": "sm,self"},
}
DESCRIPTIONS = {
    "tcp": "connector, listener endpoints (TCP)",
    "tcp-poll1": "connector, TCP, UCX_TCP_MAX_POLL=1",
    "sm": "raw ucxx, worker-address endpoints, UCX_TLS=sm,self",
}
TAG_HELLO, TAG_FRAME, TAG_ACK = 1, 2, 3  # worker-level tags of the sm arm
DEADLINE_S = 60.0
CHILD_TIMEOUT_S = 600.0


# ---- shared by the processes --------------------------------------------------------------------


def payload_for(nbytes: int) -> np.ndarray:
    """The bytes sent for a size: the receiver regenerates them to check what landed."""
    return np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)


def header_for(request_id: str, nbytes: int) -> KVHeader:
    # A plausible KV layout; only nbytes matters to the transfer.
    return KVHeader(request_id=request_id, num_tokens=nbytes // 4096, num_blocks=max(1, nbytes // 65536),
                    block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16",
                    first_token_id=1, nbytes=nbytes)


def request_ids(sizes: list[int], transfers: int) -> list[tuple[str, int]]:
    return [(f"s{nbytes}-{index}", nbytes) for nbytes in sizes for index in range(transfers)]


class LoopTicker:
    """Ticks every 1 ms in the receiver's event loop; a long gap means something blocked the loop."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float]] = []  # (time, gap since the previous tick)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.ticks.append((now, now - last))
            last = now

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def max_gap_ms(self, start: float, end: float) -> float:
        """The longest gap of a tick that ended within (start, end], plus the still-open gap at end."""
        gaps = [gap for moment, gap in self.ticks if start < moment <= end]
        before_end = [moment for moment, _ in self.ticks if moment <= end]
        open_gap = end - max(before_end) if before_end else end - start
        return 1e3 * max([*gaps, open_gap])


def receiver_report(sizes: list[int], transfers: int, done_at: dict[str, float], started: float,
                    ticker: LoopTicker, verified: dict[int, bool]) -> dict[str, Any]:
    """Per size: the worst event-loop stall while its timed payloads arrived, and the check."""
    report: dict[str, Any] = {}
    previous = started
    for request_id, nbytes in request_ids(sizes, transfers):
        stall = ticker.max_gap_ms(previous, done_at[request_id])
        previous = done_at[request_id]
        entry = report.setdefault(str(nbytes), {"max_loop_stall_ms": 0.0, "verified": verified[nbytes]})
        if not request_id.endswith("-0"):  # the warm-up transfer is not counted
            entry["max_loop_stall_ms"] = max(entry["max_loop_stall_ms"], stall)
    return report


# ---- the connector arms (tcp, tcp-poll1) ---------------------------------------------------------


async def connector_receiver(sizes: list[int], transfers: int) -> dict[str, Any]:
    from cluster.transfer.ucx import UCXReceiver

    receiver = UCXReceiver(timeout_s=DEADLINE_S)
    await receiver.start()
    buffers = {nbytes: np.zeros(nbytes, dtype=np.uint8) for nbytes in sizes}
    done_at: dict[str, float] = {}
    futures = []
    for request_id, nbytes in request_ids(sizes, transfers):
        future = receiver.expect(request_id, memoryview(buffers[nbytes]))
        future.add_done_callback(lambda _, key=request_id: done_at.__setitem__(key, time.perf_counter()))
        futures.append(future)
    ticker = LoopTicker()
    ticker.start()
    started = time.perf_counter()
    print("address", receiver.address, flush=True)
    await asyncio.wait_for(asyncio.gather(*futures), CHILD_TIMEOUT_S)
    ticker.stop()
    verified = {nbytes: bool(np.array_equal(buffer, payload_for(nbytes))) for nbytes, buffer in buffers.items()}
    await receiver.close()
    return receiver_report(sizes, transfers, done_at, started, ticker, verified)


async def connector_sender(address: str, sizes: list[int], transfers: int) -> dict[str, list[float]]:
    from cluster.transfer.ucx import UCXSender

    sender = UCXSender(timeout_s=DEADLINE_S)
    seconds: dict[str, list[float]] = {}
    payloads = {nbytes: payload_for(nbytes) for nbytes in sizes}
    for request_id, nbytes in request_ids(sizes, transfers):
        started = time.perf_counter()
        await sender.send(address, header_for(request_id, nbytes), memoryview(payloads[nbytes]))
        seconds.setdefault(str(nbytes), []).append(time.perf_counter() - started)
    await sender.close()
    return seconds


# ---- the shared-memory arm (raw ucxx, worker-address endpoints) ----------------------------------


def _ucxx() -> Any:
    from cluster.transfer.ucx import fix_progress, init_ucx

    ucxx = init_ucx()
    fix_progress()  # worker-level receives need progress on this loop before any endpoint, re-armed
    return ucxx


async def _recv(ucxx: Any, buffer: Any, tag: int) -> None:
    """A worker-level tagged receive, awaited without spinning the loop (see cluster.transfer.ucx)."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    from cluster.transfer.ucx import complete

    # Error handling is off: a dead peer would hang this forever without the deadline.
    await complete(ucxx.core._get_ctx().worker.tag_recv(Array(buffer), Tag(tag)), DEADLINE_S)


async def _send(endpoint: Any, buffer: Any, tag: int) -> None:
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    from cluster.transfer.ucx import complete

    await complete(endpoint._ep.tag_send(Array(buffer), Tag(tag)), DEADLINE_S)


async def sm_receiver(sizes: list[int], transfers: int) -> dict[str, Any]:
    ucxx = _ucxx()
    print("address", ucxx.get_worker_address().tobytes().hex(), flush=True)
    length = bytearray(8)
    await _recv(ucxx, length, TAG_HELLO)
    peer = bytearray(int.from_bytes(length, "little"))
    await _recv(ucxx, peer, TAG_HELLO)
    endpoint = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(bytes(peer)),
                                                              endpoint_error_handling=False)
    buffers = {nbytes: np.zeros(nbytes, dtype=np.uint8) for nbytes in sizes}
    ticker, done_at = LoopTicker(), {}
    ticker.start()
    started = time.perf_counter()
    for request_id, nbytes in request_ids(sizes, transfers):
        await sm_receive_frame(ucxx, buffers[nbytes])
        done_at[request_id] = time.perf_counter()
        await _send(endpoint, bytearray(1), TAG_ACK)
    ticker.stop()
    verified = {nbytes: bool(np.array_equal(buffer, payload_for(nbytes))) for nbytes, buffer in buffers.items()}
    await asyncio.sleep(0.2)  # let the last ack leave before the endpoint goes
    endpoint.abort()
    return receiver_report(sizes, transfers, done_at, started, ticker, verified)


async def sm_receive_frame(ucxx: Any, buffer: np.ndarray) -> None:
    """Length prefix, header (validated), payload straight into `buffer`."""
    prefix = bytearray(8)
    await _recv(ucxx, prefix, TAG_FRAME)
    header_bytes = bytearray(int.from_bytes(prefix, "little"))
    await _recv(ucxx, header_bytes, TAG_FRAME)
    header = KVHeader.from_bytes(bytes(header_bytes))
    assert header.nbytes == buffer.nbytes, "the benchmark's own frames are well formed"
    await _recv(ucxx, buffer, TAG_FRAME)


async def sm_sender(address: str, sizes: list[int], transfers: int) -> dict[str, list[float]]:
    ucxx = _ucxx()
    endpoint = await ucxx.create_endpoint_from_worker_address(
        ucxx.get_ucx_address_from_buffer(bytes.fromhex(address)), endpoint_error_handling=False)
    me = ucxx.get_worker_address().tobytes()
    await _send(endpoint, bytearray(len(me).to_bytes(8, "little")), TAG_HELLO)
    await _send(endpoint, bytearray(me), TAG_HELLO)
    seconds: dict[str, list[float]] = {}
    payloads = {nbytes: payload_for(nbytes) for nbytes in sizes}
    for request_id, nbytes in request_ids(sizes, transfers):
        header = header_for(request_id, nbytes).to_bytes()
        started = time.perf_counter()
        for message in (bytearray(len(header).to_bytes(8, "little")), bytearray(header), payloads[nbytes]):
            await _send(endpoint, message, TAG_FRAME)
        await _recv(ucxx, bytearray(1), TAG_ACK)
        seconds.setdefault(str(nbytes), []).append(time.perf_counter() - started)
    endpoint.abort()
    return seconds


# ---- child process entry -------------------------------------------------------------------------


def run_child(role: str, arm: str, address: str, sizes: list[int], transfers: int) -> None:
    """Run one side of an arm and print its JSON result as the last line (the parent reads it)."""
    from cluster.transfer.ucx import reset_ucx

    if role == "receiver":
        coroutine = (sm_receiver if arm == "sm" else connector_receiver)(sizes, transfers)
    else:
        coroutine = (sm_sender if arm == "sm" else connector_sender)(address, sizes, transfers)
    result = asyncio.run(coroutine)
    print("result", json.dumps(result), flush=True)
    try:
        reset_ucx()
    except Exception as error:  # a leftover reference: harmless at exit, worth a line
        print(f"ucxx.reset: {error}", file=sys.stderr)


# ---- the parent: arms, memcpy, table, files -------------------------------------------------------


def spawn(role: str, arm: str, sizes: list[int], transfers: int, address: str = "") -> subprocess.Popen[str]:
    env = {**os.environ, **ARMS[arm], "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "benchmarks.kv_transfer", "--role", role, "--arm", arm,
               "--address", address, "--transfers", str(transfers), "--sizes-bytes", *map(str, sizes)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def read_until(process: subprocess.Popen[str], prefix: str) -> str:
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    raise RuntimeError(f"child exited ({process.wait()}) without a '{prefix.strip()}' line")


def run_arm(arm: str, sizes: list[int], transfers: int) -> dict[str, Any]:
    """One receiver and one sender process; returns per-size seconds, GB/s, stall and check."""
    receiver = spawn("receiver", arm, sizes, transfers)
    sender: subprocess.Popen[str] | None = None
    try:
        address = read_until(receiver, "address ")
        sender = spawn("sender", arm, sizes, transfers, address)
        seconds = json.loads(read_until(sender, "result "))
        received = json.loads(read_until(receiver, "result "))
    finally:
        for process in (sender, receiver):
            if process is not None:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
    return summarize(sizes, seconds, received)


def summarize(sizes: list[int], seconds: dict[str, list[float]], received: dict[str, Any]) -> dict[str, Any]:
    per_size = {}
    for nbytes in sizes:
        timed = seconds[str(nbytes)][1:]  # the first transfer of each size is the warm-up
        median_s = statistics.median(timed)
        per_size[str(nbytes)] = {"seconds": timed, "median_s": median_s, "gbps": nbytes / median_s / 1e9,
                                 **received[str(nbytes)]}
    return per_size


def measure_memcpy(sizes: list[int], repeats: int) -> dict[str, Any]:
    """np.copyto of the same bytes into a buffer already written once (no page faults timed)."""
    per_size = {}
    for nbytes in sizes:
        source, target = payload_for(nbytes), np.zeros(nbytes, dtype=np.uint8)
        np.copyto(target, source)
        timed = [timed_call(lambda s=source, t=target: np.copyto(t, s)) for _ in range(repeats)]
        median_s = statistics.median(timed)
        per_size[str(nbytes)] = {"seconds": timed, "median_s": median_s, "gbps": nbytes / median_s / 1e9}
    return per_size


def timed_call(function: Callable[[], object]) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def machine_info() -> dict[str, Any]:
    import platform

    from benchmarks.common import cpu_model, git_state

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "ucx": ucx_version(), "load_average_at_start": os.getloadavg(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python -m benchmarks.kv_transfer " + " ".join(sys.argv[1:]), "git": git_state()}


def ucx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"ucxx {version('ucxx-cu12')}, libucx {version('libucx-cu12')}"
    except PackageNotFoundError:
        return "unknown"


def report(sizes: list[int], arms: dict[str, Any], memcpy: dict[str, Any]) -> None:
    from benchmarks.common import print_table

    columns = ["MiB", "memcpy GB/s", *(f"{arm} GB/s" for arm in arms), *(f"{arm} stall ms" for arm in arms)]
    rows = []
    for nbytes in sizes:
        key = str(nbytes)
        rows.append([nbytes >> 20, memcpy[key]["gbps"], *(arms[arm][key]["gbps"] for arm in arms),
                     *(arms[arm][key]["max_loop_stall_ms"] for arm in arms)])
    print_table("KV transfer between two processes (median; stall = longest receiver event-loop gap)",
                columns, rows)


def plot(sizes: list[int], arms: dict[str, Any], memcpy: dict[str, Any]) -> None:
    from benchmarks.plots import _pyplot, _save

    plt = _pyplot()
    if plt is None:
        return
    mib = [nbytes >> 20 for nbytes in sizes]
    fig, (rate, stall) = plt.subplots(1, 2, figsize=(11, 5))
    rate.plot(mib, [memcpy[str(n)]["gbps"] for n in sizes], "k--o", label="memcpy (np.copyto)")
    for arm, per_size in arms.items():
        rate.plot(mib, [per_size[str(n)]["gbps"] for n in sizes], "-o", label=DESCRIPTIONS[arm])
        stall.plot(mib, [per_size[str(n)]["max_loop_stall_ms"] for n in sizes], "-o", label=arm)
    rate.set(xscale="log", yscale="log", xlabel="payload (MiB)", ylabel="GB/s (median)",
             title="KV transfer between two processes")
    stall.set(xscale="log", xlabel="payload (MiB)", ylabel="ms", title="longest receiver event-loop stall")
    for axis in (rate, stall):
        axis.set_xticks(mib, [str(m) for m in mib])
        axis.grid(alpha=0.3)
    rate.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    stall.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)
    _save(fig, "kv-transfer")
    plt.close(fig)


def main_parent(args: argparse.Namespace) -> None:
    from benchmarks.common import console, save

    sizes = [int(mib) << 20 for mib in args.sizes_mib]
    info = machine_info()
    arms = {}
    for arm in args.arms:
        console.print(f"arm {arm}: {DESCRIPTIONS[arm]}")
        arms[arm] = run_arm(arm, sizes, args.repeats + 1)
    memcpy = measure_memcpy(sizes, args.repeats)
    report(sizes, arms, memcpy)
    save("kv-transfer", {"sizes_mib": args.sizes_mib, "repeats": args.repeats, "warmup": 1,
                         "descriptions": {arm: DESCRIPTIONS[arm] for arm in arms},
                         "environment": {arm: ARMS[arm] for arm in arms}, "arms": arms, "memcpy": memcpy}, info)
    plot(sizes, arms, memcpy)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=7, help="timed transfers per size (after one warm-up)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    # The child processes' arguments.
    parser.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--transfers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sizes-bytes", type=int, nargs="+", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.role is not None:
        run_child(args.role, args.arm, args.address, args.sizes_bytes, args.transfers)
    else:
        main_parent(args)


if __name__ == "__main__":
    main()
