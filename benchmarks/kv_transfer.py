"""KV transfer between two processes: GB/s per payload size over UCX, against a memcpy of the same bytes.

    python -m benchmarks.kv_transfer [--sizes-mib 1 4 16 64] [--repeats 7] [--arms shm tcp tcp-poll1 sm]
                                     [--kill-trials 3]

Each arm starts a fresh receiver process and a fresh sender process (UCX reads its settings once per
process). The sender times `send` (it returns once the receiver acked that the payload landed) for
each size, one warm-up then `--repeats` timed transfers, and the median is reported. The receiver
measures how long its event loop stalls (the longest gap between 1 ms ticks) while payloads arrive,
and checks the last payload of each size bit for bit.

Arms:
- shm: the connector as workers on one host use it (`cluster.transfer.shm`): each payload written
  into the receiver's /dev/shm landing segment (one per transfer, allocated before it, as a decode
  worker does at reservation: `segment_alloc_ms`), control (header, marker, ack) over UCX/TCP.
- tcp: the connector (`cluster.transfer.ucx`) with shared memory off, listener endpoints with error
  handling: TCP (what workers on two hosts use).
- tcp-poll1: the same with UCX_TCP_MAX_POLL=1 (UCX drains a socket less greedily per progress call).
- sm: raw ucxx with worker-address endpoints, error handling off and UCX_TLS=sm,self (shared memory,
  see docs/performance.md, "UCX's transports here"): the same three messages per transfer as the connector's
  wire format, minus the payload size probe, awaited the same way (`cluster.transfer.ucx.complete`). Not
  part of the connector: a dead peer hangs it, so every operation here runs under a deadline.
Killed peers (`--kill-trials`, the shm arm): a sender streams 64 MiB transfers to a receiver; the
receiver process is killed with SIGKILL (the sender must raise TransferError), then, in another
pair, the sender is (the receiver must fail the transfer it was receiving). Reported: seconds from
the kill to the survivor's TransferError (CLOCK_MONOTONIC is shared by the processes).
Baselines, in the same run (`measure_memcpy`): `memcpy`, np.copyto into one destination again and
again (as every run reported; at 16 MiB partly within the L3), and `copies`: memcpy into as many
destinations in turn as the shm arm's landing segments (`ROTATING`, the transfer's shape), and the
shm arm's own copy (`cluster.transfer.stream_copy`: streaming stores from 16 MiB) into them.
Results go to benchmarks/results/kv-transfer.<machine>.<date>.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cluster.transfer import shm
from cluster.transfer.connector import MAX_HEADER_BYTES, KVHeader
from cluster.transfer.phases import breakdown

ROOT = Path(__file__).resolve().parent.parent
ARMS: dict[str, dict[str, str]] = {
    "shm": {},
    "tcp": {},
    "tcp-poll1": {"UCX_TCP_MAX_POLL": "1"},
    "sm": {"UCX_TLS": "sm,self"},
}
DESCRIPTIONS = {
    "shm": "connector, same host: /dev/shm segment + UCX/TCP control",
    "tcp": "connector, shared memory off: listener endpoints (TCP)",
    "tcp-poll1": "connector, TCP, UCX_TCP_MAX_POLL=1",
    "sm": "raw ucxx, worker-address endpoints, UCX_TLS=sm,self",
}
TAG_HELLO, TAG_FRAME, TAG_ACK = 1, 2, 3  # worker-level tags of the sm arm
DEADLINE_S = 60.0
CHILD_TIMEOUT_S = 600.0
# Transfers of each size not timed (a sender maps each segment once, at its first use), and how many transfers
# a receiver expects ahead (so that the sender never waits for an `expect`).
WARMUP = LOOKAHEAD = 2
ROTATING = LOOKAHEAD + 1  # landing segments of a size the shm arm's transfers write into, in turn
KILL_NBYTES = 64 << 20
KILL_TRANSFERS = 50  # more than a trial sends before its kill
KILL_WAIT_S = 15.0  # a survivor that has not seen the kill by then: reported as not detected


# ---- shared by the processes --------------------------------------------------------------------


def payload_for(nbytes: int) -> np.ndarray:
    """The bytes sent for a size: the receiver regenerates them to check what landed."""
    return np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)


def header_for(request_id: str, nbytes: int) -> KVHeader:
    # A plausible KV layout; only nbytes matters to the transfer.
    return KVHeader(request_id=request_id, num_tokens=nbytes // 4096, num_blocks=max(1, nbytes // 65536),
                    block_size=16, num_layers=30, num_kv_heads=3, head_dim=64, dtype="bfloat16",
                    first_token_id=1, nbytes=nbytes, token=token_for(request_id))


def token_for(request_id: str) -> str:
    """The transfer's token, known to both processes (a worker's is random; here it needs no exchange)."""
    return request_id.encode().hex()


def landings_file(address: str) -> Path:
    """Where the receiver at `address` lists its transfers' segment names ("ID NAME" lines): the
    benchmark's stand-in for the ticket that carries the name in serving (the name is random)."""
    same = shm.SameHost.of(address)
    assert same is not None, "the receiver offers no shared memory"
    return Path(tempfile.gettempdir()) / f"pdserve-bench-{same.receiver_id}.landings"


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
        if int(request_id.rpartition("-")[2]) >= WARMUP:  # the warm-up transfers are not counted
            entry["max_loop_stall_ms"] = max(entry["max_loop_stall_ms"], stall)
    return report


# ---- the connector arms (tcp, tcp-poll1) ---------------------------------------------------------


async def connector_receiver(sizes: list[int], transfers: int, shared: bool, kill: bool = False) -> dict[str, Any]:
    """Expect the transfers LOOKAHEAD at a time, as a decode worker reserves them: with `shared`,
    each in a landing segment allocated (and timed) when it is expected and dropped once it landed
    (so segments are reused, as in serving); else in one buffer per size. `kill`: print "failed
    MONOTONIC" at the first transfer that fails, and wait to be killed."""
    from cluster.transfer.ucx import UCXReceiver

    receiver = UCXReceiver(timeout_s=DEADLINE_S, shared_memory=shared)
    await receiver.start()
    receiver.phases.on = shared and not kill
    first_use = await new_segment_stall(receiver, max(sizes)) if shared and not kill else {}
    for nbytes in sizes if shared else []:  # the pool warmed up, as a decode worker's is after its first requests:
        await receiver.prefault_landing(nbytes, ROTATING)  # an `expect` never waits for a new segment
    plain = {nbytes: np.zeros(nbytes, dtype=np.uint8) for nbytes in sizes} if not shared else {}
    alloc_ms: dict[str, list[float]] = {}
    done_at: dict[str, float] = {}
    verified: dict[int, bool] = {}
    upcoming = iter(request_ids(sizes, transfers))
    pending: collections.deque[tuple[str, int, np.ndarray, asyncio.Future[Any]]] = collections.deque()

    async def expect_next() -> None:
        request_id, nbytes = next(upcoming, ("", 0))
        if not request_id:
            return
        started = time.perf_counter()
        landing = await receiver.landing_memory(token_for(request_id), nbytes) if shared else None
        alloc_ms.setdefault(str(nbytes), []).append(1e3 * (time.perf_counter() - started))
        buffer = plain[nbytes] if landing is None else np.frombuffer(landing, np.uint8)
        future = receiver.expect(request_id, memoryview(buffer), token_for(request_id))
        if landing is not None:
            with landings_file(receiver.address).open("a") as names:
                names.write(f"{request_id} {receiver.landing_name(token_for(request_id))}\n")
        future.add_done_callback(lambda done, key=request_id: on_landed(done, key, done_at, kill))
        pending.append((request_id, nbytes, buffer, future))

    for _ in range(LOOKAHEAD):
        await expect_next()
    ticker = LoopTicker()
    ticker.start()
    started = time.perf_counter()
    print("address", receiver.address, flush=True)
    while pending:
        request_id, nbytes, buffer, future = pending.popleft()
        try:
            await asyncio.wait_for(future, CHILD_TIMEOUT_S)
        except Exception:
            if kill:
                await asyncio.Event().wait()  # until killed
            raise
        if request_id.endswith(f"-{transfers - 1}"):  # each size's last payload is checked
            verified[nbytes] = bool(np.array_equal(buffer, payload_for(nbytes)))
        del buffer, future  # its segment goes back to the pool, as after a decode worker's import
        await expect_next()
    ticker.stop()
    if shared:
        landings_file(receiver.address).unlink(missing_ok=True)
    await receiver.close()
    report = receiver_report(sizes, transfers, done_at, started, ticker, verified)
    for nbytes in sizes:
        report[str(nbytes)]["segment_alloc_ms"] = statistics.median(alloc_ms[str(nbytes)]) if shared else 0.0
    report["_new_segment"], report["_phases"] = first_use, receiver.phases.marks
    return report


async def new_segment_stall(receiver: Any, nbytes: int) -> dict[str, float]:
    """A new segment of `nbytes` (none is pooled yet) made while a 1 ms ticker runs: how long the
    allocation took and the longest the event loop stood still meanwhile (its pages are faulted in
    on a thread: the loop should not stall for the allocation's length)."""
    ticker = LoopTicker()
    ticker.start()
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    landing = await receiver.landing_memory("f1e5", nbytes)
    ended = time.perf_counter()
    await asyncio.sleep(0.005)
    ticker.stop()
    if landing is not None:  # not used for a transfer: its name goes
        receiver.expect("new-segment", memoryview(landing), "f1e5")
        receiver.cancel("new-segment")
    return {"nbytes": nbytes, "alloc_ms": 1e3 * (ended - started),
            "max_loop_stall_ms": ticker.max_gap_ms(started, ended + 0.005)}


def on_landed(done: asyncio.Future[Any], request_id: str, done_at: dict[str, float], kill: bool) -> None:
    done_at[request_id] = time.perf_counter()
    if kill and not done.cancelled() and done.exception() is not None and "failed" not in done_at:
        done_at["failed"] = time.monotonic()
        print("failed", time.monotonic(), repr(done.exception())[:200], flush=True)


async def connector_sender(address: str, sizes: list[int], transfers: int, shared: bool,
                           kill: bool = False) -> dict[str, Any]:
    """Send every transfer, timed. `kill`: print "sent" after each, and "failed MONOTONIC" at the
    first TransferError (then stop)."""
    from cluster.transfer.connector import TransferError
    from cluster.transfer.ucx import UCXSender

    sender = UCXSender(timeout_s=DEADLINE_S, shared_memory=shared)
    sender.phases.on = shared and not kill
    seconds: dict[str, Any] = {}
    payloads = {nbytes: payload_for(nbytes) for nbytes in sizes}
    expected = "shm" if shared else "ucx"
    landings: dict[str, str] = {}
    for request_id, nbytes in request_ids(sizes, transfers):
        if shared:  # as in serving, where the ticket exists only once the decode worker reserved
            await reserved(sender, address, request_id, landings)
        started = time.perf_counter()
        try:
            transport = await sender.send(address, header_for(request_id, nbytes), memoryview(payloads[nbytes]),
                                          landings.get(request_id, ""))
        except TransferError as error:
            if not kill:
                raise
            print("failed", time.monotonic(), repr(error)[:200], flush=True)
            break
        seconds.setdefault(str(nbytes), []).append(time.perf_counter() - started)
        assert transport == expected, f"the payload took {transport}, not {expected}"
        if kill:
            print("sent", request_id, flush=True)
    await sender.close()
    seconds["_phases"] = sender.phases.marks
    return seconds


async def reserved(sender: Any, address: str, request_id: str, landings: dict[str, str]) -> None:
    """Until the receiver made the transfer's landing segment (and expected it, in the same step) and
    listed its name in `landings_file`, read into `landings`; not timed: on a loaded machine the
    receiver's loop can fall a transfer or two behind the sender, which would then send a frame not
    yet expected (refused) or not in place (no segment yet)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            landings.update(line.split(" ", 1) for line in landings_file(address).read_text().splitlines())  # type: ignore[misc]
        if sender.transport_to(address, landings.get(request_id, "")) == "shm":
            return
        await asyncio.sleep(0.0002)


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
    """Length prefix and header (one message; validated), payload straight into `buffer`."""
    opening = bytearray(8 + MAX_HEADER_BYTES)  # a shorter message fills its start
    await _recv(ucxx, opening, TAG_FRAME)
    header = KVHeader.from_bytes(bytes(opening[8:8 + int.from_bytes(opening[:8], "little")]))
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
        for message in (bytearray(len(header).to_bytes(8, "little") + header), payloads[nbytes]):
            await _send(endpoint, message, TAG_FRAME)
        await _recv(ucxx, bytearray(1), TAG_ACK)
        seconds.setdefault(str(nbytes), []).append(time.perf_counter() - started)
    endpoint.abort()
    return seconds


# ---- child process entry -------------------------------------------------------------------------


def run_child(role: str, arm: str, address: str, sizes: list[int], transfers: int, kill: bool) -> None:
    """Run one side of an arm and print its JSON result as the last line (the parent reads it)."""
    from cluster.transfer.ucx import reset_ucx

    coroutine: Any
    if arm == "sm":
        coroutine = sm_receiver(sizes, transfers) if role == "receiver" else sm_sender(address, sizes, transfers)
    elif role == "receiver":
        coroutine = connector_receiver(sizes, transfers, arm == "shm", kill)
    else:
        coroutine = connector_sender(address, sizes, transfers, arm == "shm", kill)
    result = asyncio.run(coroutine)
    print("result", json.dumps(result), flush=True)
    try:
        reset_ucx()
    except Exception as error:  # a leftover reference: harmless at exit, worth a line
        print(f"ucxx.reset: {error}", file=sys.stderr)


# ---- the parent: arms, memcpy, table, files -------------------------------------------------------


def spawn(role: str, arm: str, sizes: list[int], transfers: int, address: str = "",
          kill: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, **ARMS[arm], "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONPATH": str(ROOT)}
    if kill:
        env["UCXX_LOG_LEVEL"] = "FATAL"  # the survivor's "endpoint error" lines are the point, not news
    command = [sys.executable, "-m", "benchmarks.kv_transfer", "--role", role, "--arm", arm,
               "--address", address, "--transfers", str(transfers), "--sizes-bytes", *map(str, sizes),
               *(["--kill-mode"] if kill else [])]
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


def measure_kill(victim: str, arm: str = "shm") -> dict[str, Any]:
    """Kill the `victim` ("receiver" or "sender") of a pair streaming 64 MiB transfers, a few
    transfers in (the sender mid-copy, most likely: the copy is most of a transfer); returns the
    seconds until the survivor raised TransferError (None: not within KILL_WAIT_S)."""
    import signal
    import threading

    receiver = spawn("receiver", arm, [KILL_NBYTES], KILL_TRANSFERS, kill=True)
    sender: subprocess.Popen[str] | None = None
    try:
        address = read_until(receiver, "address ")
        sender = spawn("sender", arm, [KILL_NBYTES], KILL_TRANSFERS, address, kill=True)
        read_until(sender, "sent ")
        read_until(sender, "sent ")
        before = time.monotonic()
        read_until(sender, "sent ")
        time.sleep((time.monotonic() - before) / 2)  # halfway into the next transfer: mid-copy, most likely
        dead, survivor = (receiver, sender) if victim == "receiver" else (sender, receiver)
        dead.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        seen: list[str] = []
        reader = threading.Thread(target=lambda: seen.append(read_until(survivor, "failed ")), daemon=True)
        reader.start()
        reader.join(KILL_WAIT_S)
        detected_s = float(seen[0].split()[0]) - killed_at if seen else None
        return {"victim": victim, "detected_s": detected_s, "error": seen[0].split(maxsplit=1)[1] if seen else "",
                "note": "" if seen else f"no TransferError within {KILL_WAIT_S} s (killed between transfers: "
                                        "the router's recompute covers that case)"}
    finally:
        for process in (sender, receiver):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        from cluster.transfer.shm import Segments

        Segments().remove_orphans()  # the killed receivers' segments


def summarize(sizes: list[int], seconds: dict[str, Any], received: dict[str, Any]) -> dict[str, Any]:
    per_size: dict[str, Any] = {}
    sender_marks, receiver_marks = seconds.get("_phases", []), received.get("_phases", [])
    transfers = len(seconds[str(sizes[0])])
    for nbytes in sizes:
        timed = seconds[str(nbytes)][WARMUP:]  # not timed: the first segments of a size are new
        median_s = statistics.median(timed)
        per_size[str(nbytes)] = {"seconds": timed, "median_s": median_s, "gbps": nbytes / median_s / 1e9,
                                 **received[str(nbytes)]}
        if sender_marks:
            steps = [breakdown(sender_marks, receiver_marks, request_id)
                     for request_id, _ in request_ids([nbytes], transfers)[WARMUP:]]
            per_size[str(nbytes)]["phases_ms"] = {name: statistics.median(step[name] for step in steps)
                                                  for name in steps[0] if all(name in step for step in steps)}
    if received.get("_new_segment"):
        per_size["new_segment"] = received["_new_segment"]
    return per_size


def measure_memcpy(sizes: list[int], repeats: int, destinations: int = 1,
                   copy: Callable[[np.ndarray, np.ndarray], object] = np.copyto) -> dict[str, Any]:
    """`copy` (np.copyto: glibc's memcpy) of the same bytes into `destinations` buffers in turn, each
    written once before (no page faults timed).

    One destination is the `memcpy` baseline every run reported: at 16 MiB its source and
    destination (32 MiB) fit this CPU's 32 MiB L3, so much of it is copied within the cache. The shm
    arm writes into LOOKAHEAD + 1 landing segments in turn (`ROTATING`), which the cache does not
    hold: `copies` in the JSON has memcpy into as many destinations (the transfer's shape) and the
    shm arm's own copy (`cluster.transfer.stream_copy`: streaming stores from 16 MiB) into them."""
    per_size = {}
    for nbytes in sizes:
        source = payload_for(nbytes)
        targets = [np.zeros(nbytes, dtype=np.uint8) for _ in range(destinations)]
        for target in targets:
            np.copyto(target, source)
        timed = [timed_call(lambda s=source, t=targets[index % destinations]: copy(t, s)) for index in range(repeats)]
        median_s = statistics.median(timed)
        per_size[str(nbytes)] = {"seconds": timed, "median_s": median_s, "gbps": nbytes / median_s / 1e9}
    return per_size


def measure_copies(sizes: list[int], repeats: int) -> dict[str, Any]:
    """The rotating-destination copies (`measure_memcpy`): glibc's memcpy and the shm arm's copy."""
    from cluster.transfer import stream_copy

    asyncio.run(stream_copy.ready())
    stream = "streaming stores from 16 MiB" if stream_copy.library() is not None else "plain (no C compiler here)"
    return {"memcpy_rotating": measure_memcpy(sizes, repeats, ROTATING),
            "stream_rotating": measure_memcpy(sizes, repeats, ROTATING,
                                              lambda t, s: stream_copy.copy(memoryview(t), memoryview(s),
                                                                            stream_copy.streams(s.nbytes))),
            "destinations": ROTATING, "stream_copy": stream}


def lscpu_flags() -> str:
    try:
        output = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in output.splitlines() if line.startswith("Flags")), "")


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


def report(sizes: list[int], arms: dict[str, Any], memcpy: dict[str, Any], kills: list[dict[str, Any]],
           copies: dict[str, Any]) -> None:
    from benchmarks.common import console, print_table

    columns = ["MiB", "memcpy GB/s", *(f"{arm} GB/s" for arm in arms), *(f"{arm} stall ms" for arm in arms)]
    rows = []
    for nbytes in sizes:
        key = str(nbytes)
        rows.append([nbytes >> 20, memcpy[key]["gbps"], *(arms[arm][key]["gbps"] for arm in arms),
                     *(arms[arm][key]["max_loop_stall_ms"] for arm in arms)])
    print_table("KV transfer between two processes (median; stall = longest receiver event-loop gap)",
                columns, rows)
    if "shm" in arms:
        for nbytes in sizes:
            key = str(nbytes)
            shm_gbps, rotating = arms["shm"][key]["gbps"], copies["memcpy_rotating"][key]["gbps"]
            console.print(f"shm at {nbytes >> 20} MiB: {shm_gbps / memcpy[key]['gbps']:.0%} of memcpy, "
                          f"{shm_gbps / rotating:.0%} of memcpy into {copies['destinations']} buffers in turn "
                          f"({rotating:.2f} GB/s; the shm arm's copy alone: "
                          f"{copies['stream_rotating'][key]['gbps']:.2f}, {copies['stream_copy']}); landing "
                          f"segment allocated in {arms['shm'][key]['segment_alloc_ms']:.1f} ms beforehand")
            phases = arms["shm"][key].get("phases_ms", {})
            console.print("  phases (median ms): " + ", ".join(f"{name} {ms:.3f}" for name, ms in phases.items()))
        new = arms["shm"].get("new_segment")
        if new:
            console.print(f"a new {new['nbytes'] >> 20} MiB segment: allocated in {new['alloc_ms']:.1f} ms, the "
                          f"receiver's loop stood still {new['max_loop_stall_ms']:.1f} ms at most meanwhile")
    for kill in kills:
        seen = "not seen" if kill["detected_s"] is None else f"{kill['detected_s']:.3f} s"
        console.print(f"{kill['victim']} killed: the survivor raised TransferError after {seen} {kill['note']}")


def plot(sizes: list[int], arms: dict[str, Any], memcpy: dict[str, Any], copies: dict[str, Any]) -> None:
    from benchmarks.common import result_path
    from cluster.bench.plots import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    mib = [nbytes >> 20 for nbytes in sizes]
    fig, (rate, stall) = plt.subplots(1, 2, figsize=(11, 5))
    rate.plot(mib, [memcpy[str(n)]["gbps"] for n in sizes], "k--o", label="memcpy (np.copyto)")
    rate.plot(mib, [copies["memcpy_rotating"][str(n)]["gbps"] for n in sizes], "k:o",
              label=f"memcpy into {copies['destinations']} buffers in turn")
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
    save_figure(fig, result_path("kv-transfer", ".png"))


def main_parent(args: argparse.Namespace) -> None:
    from benchmarks.common import console, save

    sizes = [int(mib) << 20 for mib in args.sizes_mib]
    info = machine_info()
    arms = {}
    for arm in args.arms:
        console.print(f"arm {arm}: {DESCRIPTIONS[arm]}")
        arms[arm] = run_arm(arm, sizes, args.repeats + WARMUP)
    memcpy, copies = measure_memcpy(sizes, args.repeats), measure_copies(sizes, args.repeats)
    kills = [measure_kill(victim) for _ in range(args.kill_trials) for victim in ("receiver", "sender")]
    report(sizes, arms, memcpy, kills, copies)
    save("kv-transfer", {"sizes_mib": args.sizes_mib, "repeats": args.repeats, "warmup": WARMUP,
                         "descriptions": {arm: DESCRIPTIONS[arm] for arm in arms},
                         "environment": {arm: ARMS[arm] for arm in arms}, "arms": arms, "memcpy": memcpy,
                         "copies": copies, "killed_peer": kills, "lscpu_flags": lscpu_flags()}, info)
    plot(sizes, arms, memcpy, copies)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=7, help="timed transfers per size (after one warm-up)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--kill-trials", type=int, default=3,
                        help="killed-peer trials (shm arm), each killing a receiver and then a sender")
    # The child processes' arguments.
    parser.add_argument("--role", choices=["receiver", "sender"], help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    parser.add_argument("--transfers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sizes-bytes", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--kill-mode", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.role is not None:
        run_child(args.role, args.arm, args.address, args.sizes_bytes, args.transfers, args.kill_mode)
    else:
        main_parent(args)


if __name__ == "__main__":
    main()
