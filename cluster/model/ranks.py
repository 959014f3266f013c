"""The processes of a tensor-parallel engine's ranks > 0, started and stopped by the engine.

Rank 0 is the engine's own runner, in the engine's process: it schedules, samples and sends each
step to the others (`cluster.model.tensor_parallel`). Each other rank is a process of its own
(spawned: a fork would copy the parent's threads' locks and its CUDA context) that builds its shard
of the model from the weights rank 0 sends, then loops: read a command from rank 0's pipe, run the
same runner call on its own heads, until told to stop or until the pipe closes because rank 0's
process ended, however it ended. No rank outlives its engine.

```
 engine process (rank 0)                         rank r process (r = 1 .. size-1)
   ModelRunner(group) ── header (pipe) ────────>   recv_bytes ─> follow_step / _read / _write ...
        │               tensors (gloo broadcast)      │
        └── all_reduce in every layer ────────────────┘
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from cluster.model.architecture import ArchitectureConfig
from cluster.model.runner import ModelRunner
from cluster.model.tensor_parallel import TensorParallelGroup, rank_device

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a rank's process up to its join of the group (imports, CUDA init)
STOP_TIMEOUT_S = 10.0
STORE_TIMEOUT = datetime.timedelta(seconds=START_TIMEOUT_S)


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What a rank's process needs to build its runner: everything but the weights, which rank 0 sends."""

    arch: ArchitectureConfig
    runner_options: dict[str, Any]  # `ModelRunner`'s keywords (dtype, device, ...), but `group`
    threads: int  # torch's intra-op threads of the rank's process


class Ranks:
    """Ranks 1..size-1 of one engine: their processes and rank 0's end of the group."""

    def __init__(self, group: TensorParallelGroup, processes: list[BaseProcess], store: dist.Store) -> None:
        self.group = group
        self.processes = processes
        self.store = store  # rank 0 serves the group's store: it lives as long as the group

    @classmethod
    def start(cls, size: int, spec: RankSpec, device: torch.device) -> Ranks:
        """Spawn ranks 1..size-1 and join the group with them as rank 0. A rank that fails to start is
        reported with its exit code, and every rank started is stopped."""
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        pipes: list[Connection] = []
        processes: list[BaseProcess] = []
        try:
            for rank in range(1, size):
                ours, theirs = context.Pipe()
                process = context.Process(target=run_rank, args=(rank, size, store.port, theirs, spec),
                                          name=f"pdserve-rank-{rank}", daemon=True)
                process.start()
                theirs.close()  # the child's end lives in the child alone: each side sees the other's end as EOF
                pipes.append(ours)
                processes.append(process)
            for pipe, started in zip(pipes, processes, strict=True):
                wait_ready(pipe, started)
            group = TensorParallelGroup.join(0, size, store, device, pipes)
        except BaseException:
            stop_processes(processes, pipes)
            raise
        return cls(group, processes, store)

    def stop(self) -> None:
        """Tell every rank to stop, wait for them, then end any that did not."""
        for pipe in self.group.pipes:
            with contextlib.suppress(OSError):  # that rank is gone already
                pipe.send_bytes(b'{"command": "stop", "tensors": []}')
        stop_processes(self.processes, self.group.pipes)


def wait_ready(pipe: Connection, process: BaseProcess) -> None:
    """Until the rank says it is about to join the group; RuntimeError if its process ends first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not pipe.poll(0.1):
        if not process.is_alive():
            raise RuntimeError(f"tensor-parallel {process.name} ended before joining (exit code {process.exitcode})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel {process.name} did not start within {START_TIMEOUT_S:.0f} s")
    pipe.recv_bytes()


def stop_processes(processes: Iterable[BaseProcess], pipes: Iterable[Connection]) -> None:
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()


def run_rank(rank: int, size: int, port: int, pipe: Connection, spec: RankSpec) -> None:
    """A rank's process: join the group, load its shard, then follow rank 0 until it stops or is gone."""
    torch.set_num_threads(spec.threads)
    device = rank_device(torch.device(spec.runner_options["device"]), rank)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=STORE_TIMEOUT)
    pipe.send_bytes(b"ready")
    group = TensorParallelGroup.join(rank, size, store, device, [pipe])
    try:
        options = {**spec.runner_options, "device": str(device)}
        runner = ModelRunner(spec.arch, group.receive_weights(device), **options, group=group)
        follow(runner, group, device)
    except EOFError:  # rank 0's process ended: so does this one
        log.warning("tensor-parallel rank %d: rank 0 is gone, stopping", rank)
    finally:
        group.close()


def follow(runner: ModelRunner, group: TensorParallelGroup, device: torch.device) -> None:
    """Run rank 0's commands, in its order, until it says stop."""
    handlers: dict[str, Callable[[dict[str, Any], list[torch.Tensor]], None]] = {
        "step": runner.follow_step,
        "allocate": lambda h, _: runner.allocate_kv_cache(h["num_blocks"], h["max_model_len"]),
        "profile": lambda h, _: runner.follow_profile(h["num_tokens"], h["logits_rows"]),
        "read": lambda h, _: runner.follow_read(h["block_ids"]),
        "write": lambda h, t: runner.follow_write(h["block_ids"], t[0]),
        "release": lambda h, _: runner.release(h["request_id"]),
        "allocate_host": lambda h, _: runner.allocate_host_kv(h["num_slots"], h["disk_dir"]),
        "host_copies": lambda h, _: runner.follow_host_copies(h["host"]),
    }
    while True:
        header, tensors = group.receive(device)
        if header["command"] == "stop":
            return
        handlers[header["command"]](header, tensors)
