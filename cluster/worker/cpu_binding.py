"""Cores kept for the front door: the engines compute on the others.

torch's threads meet at a barrier after every op, so a thread that loses its core for a moment
holds its whole team up: a worker whose cores the gateway, the router, Ray and a load client share
spends more CPU on the same requests than the engine alone (docs/performance.md). vLLM's CPU backend
answers this by reserving cores for its API server (VLLM_CPU_NUM_OF_RESERVED_CPU); `reserved_cpus: K`
does the same here: the gateway process, and with it every process it starts (Ray's, the router, the
workers), runs on the first K cores of the host, and each worker's engine thread, with the OpenMP
threads it starts, on the rest, where it computes as fast as the engine alone on those cores. It is
worth it where K is a small part of the cores: on a 2-core host it halves the engine's, and sharing
serves more (it is off by default).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_CPUS = Path("/sys/fs/cgroup/cpuset.cpus.effective")


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8,10-11` (the kernel's list format) as sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def host_cpus() -> list[int]:
    """The CPUs this container may use: its cgroup's set where there is one (a process started by
    one already bound elsewhere still sees them all), else every online CPU."""
    try:
        cpus = parse_cpu_list(CGROUP_CPUS.read_text())
    except (OSError, ValueError):
        cpus = []
    return cpus or list(range(os.cpu_count() or 1))


@dataclass(frozen=True, slots=True)
class CpuSplit:
    """Which cores the front door (and every thread but the engines') runs on, and which the engines do."""

    front_door: frozenset[int]
    engines: frozenset[int]


def split_cpus(reserved: int, cpus: list[int] | None = None) -> CpuSplit | None:
    """The first `reserved` of the host's CPUs for the front door, the rest for the engines; None
    when nothing is reserved. A reservation that leaves no core to compute on is refused."""
    if reserved <= 0:
        return None
    cpus = sorted(cpus if cpus is not None else host_cpus())
    if reserved >= len(cpus):
        raise ValueError(f"reserved_cpus ({reserved}) must leave the engines a core: this host has {len(cpus)}")
    return CpuSplit(frozenset(cpus[:reserved]), frozenset(cpus[reserved:]))


def bind_thread(cpus: frozenset[int]) -> None:
    """The calling thread (Linux: an affinity set through pid 0 is the calling thread's) on `cpus`;
    threads it starts afterwards (OpenMP's, at its first parallel op) inherit them."""
    os.sched_setaffinity(0, cpus)


def bind_process(cpus: frozenset[int]) -> None:
    """Every thread of this process on `cpus`, and so every thread and process started afterwards."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue


def reserve_front_door(reserved: int) -> CpuSplit | None:
    """Bind this process (a gateway, a router, a worker) to the front door's cores; the split."""
    split = split_cpus(reserved)
    if split is not None:
        bind_process(split.front_door)
        log.info("front door on cores %s, engines on %s", sorted(split.front_door), sorted(split.engines))
    return split
