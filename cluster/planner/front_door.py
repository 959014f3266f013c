"""The front door's CPU on the cores the workers share: read from /proc, split into three costs.

On a machine whose cores the workers' engine threads fill (two 1-thread workers on 2 cores), the
rest of the cluster takes its CPU from them: the router, Ray's own processes (raylet, GCS), each
worker's event loop and Ray threads (every token is an event through them), and the client when it
runs there. The simulator counts it as cores taken (`simulator.front_door_cores`); here it is
measured, as CPU time of a process tree over windows of a run:
- `CpuMeter.sample`: every thread's CPU seconds (utime + stime) in the tree under a root process
  (an embedded Ray cluster's processes are all under its driver);
- `CpuMeter.window`: the CPU between two samples, less each worker's engine thread (in a process
  whose title names the worker actor, the thread that used the most CPU in the window: the step's
  compute, which the profile already times);
- `front_door_costs`: from an idle window, a window of lone requests and a loaded one, what the
  front door costs idle (cores), per request and per token (CPU seconds).
Linux only (/proc); standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
WORKER_MARKER = "WorkerActor"  # in a Ray worker actor's process title (`ray::WorkerActor...`)
Sample = dict[tuple[int, int], float]  # (pid, tid) -> CPU seconds so far


@dataclass(frozen=True, slots=True)
class CpuWindow:
    """CPU seconds the front door used over `wall_s` seconds in which `requests` requests were served,
    `tokens` tokens streamed."""

    cpu_s: float
    wall_s: float
    requests: int = 0
    tokens: int = 0


def front_door_costs(idle: CpuWindow, lone: CpuWindow, loaded: CpuWindow) -> tuple[float, float, float]:
    """(idle cores, CPU seconds per request, CPU seconds per token). The idle window gives the rate
    with nothing served (the router's load polls, Ray's heartbeats); in the other two, the CPU above
    that rate is `requests x per_request + tokens x per_token`: two equations, two unknowns (lone
    one-token requests weigh the per-request part, a loaded run the per-token part). Noise that
    would make one cost negative puts the loaded window's CPU all on the other: never below 0."""
    idle_cores = max(idle.cpu_s / idle.wall_s, 0.0) if idle.wall_s > 0 else 0.0
    above = [max(w.cpu_s - idle_cores * w.wall_s, 0.0) for w in (lone, loaded)]
    determinant = lone.requests * loaded.tokens - lone.tokens * loaded.requests
    if determinant:
        per_request = (above[0] * loaded.tokens - lone.tokens * above[1]) / determinant
        per_token = (lone.requests * above[1] - loaded.requests * above[0]) / determinant
        if per_request >= 0 and per_token >= 0:
            return idle_cores, per_request, per_token
        if per_token < 0 and loaded.requests:
            return idle_cores, above[1] / loaded.requests, 0.0
    if loaded.tokens:
        return idle_cores, 0.0, above[1] / loaded.tokens
    return idle_cores, above[1] / loaded.requests if loaded.requests else 0.0, 0.0

def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it, now."""
    children: dict[int, list[int]] = {}
    for stat in PROC.glob("[0-9]*/stat"):
        fields = _fields(stat)
        if fields:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


class CpuMeter:
    """CPU time of the processes under `root` (the driver of an embedded Ray cluster)."""

    def __init__(self, root: int | None = None, worker_marker: str = WORKER_MARKER) -> None:
        self.root = os.getpid() if root is None else root
        self.worker_marker = worker_marker
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.workers: set[int] = set()  # pids whose title named a worker when sampled

    def sample(self) -> Sample:
        cpu: Sample = {}
        for pid in process_tree(self.root):
            try:
                title = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # ended meanwhile
            if self.worker_marker in title:
                self.workers.add(pid)
            for stat in (PROC / str(pid) / "task").glob("[0-9]*/stat"):
                fields = _fields(stat)
                if fields:  # utime and stime: fields 14 and 15 of stat(5), 11 and 12 after the name
                    cpu[(pid, int(stat.parent.name))] = (int(fields[11]) + int(fields[12])) / self.ticks
        return cpu

    def window(self, before: Sample, after: Sample) -> tuple[float, float]:
        """(front door CPU seconds, engine threads' CPU seconds) between two samples. Threads that
        ended meanwhile are lost (their CPU after `before` too): short-lived ones are few here."""
        used: dict[int, list[float]] = {}
        for key, seconds in after.items():
            used.setdefault(key[0], []).append(max(seconds - before.get(key, 0.0), 0.0))
        front_door = engine = 0.0
        for pid, threads in used.items():
            busiest = max(threads) if pid in self.workers else 0.0
            engine += busiest
            front_door += sum(threads) - busiest
        return front_door, engine


def _fields(stat: Path) -> list[str]:
    """stat(5)'s fields after the command name (which may hold spaces and parentheses): [state, ppid, ...]."""
    try:
        text = stat.read_text()
    except OSError:
        return []
    return text[text.rfind(")") + 2:].split()


def machine_busy_s() -> float:
    """CPU seconds this machine's cores have been busy since boot, whoever ran (user, nice, system,
    irq, softirq and steal time: /proc/stat's first line)."""
    fields = (PROC / "stat").read_text().split("\n", 1)[0].split()[1:9]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def processes_cpu_s(pids: list[int]) -> float:
    """CPU seconds the processes `pids` have used so far (all their threads); one that ended counts 0."""
    total = 0
    for pid in pids:
        fields = _fields(PROC / str(pid) / "stat")
        if fields:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Cores taken by processes outside the tree under `root` (other jobs on the host), over time:
    what a loaded machine's run must be read against (the simulator does not model them)."""

    def __init__(self, root: int | None = None) -> None:
        self.pids = process_tree(os.getpid() if root is None else root)  # the cluster's: started already
        self.samples: list[tuple[float, float, float]] = []  # (wall, machine busy, the tree's CPU)

    def sample(self, wall_s: float) -> None:
        self.samples.append((wall_s, machine_busy_s(), processes_cpu_s(self.pids)))

    def timeline(self) -> list[tuple[float, float, float]]:
        """(start, end, cores the other processes took) between consecutive samples."""
        return [(t0, t1, max((m1 - m0) - (c1 - c0), 0.0) / (t1 - t0))
                for (t0, m0, c0), (t1, m1, c1) in zip(self.samples, self.samples[1:], strict=False) if t1 > t0]


def cores_between(timeline: list[tuple[float, float, float]], start: float, end: float) -> float:
    """The time-weighted mean of a timeline's cores over [start, end] (the part it covers; 0 if none)."""
    weighted = covered = 0.0
    for t0, t1, cores in timeline:
        overlap = min(t1, end) - max(t0, start)
        if overlap > 0:
            weighted += cores * overlap
            covered += overlap
    return weighted / covered if covered else 0.0
