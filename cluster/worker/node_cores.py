"""The cores of one host, shared by the workers on it: a busy engine runs on every core no other busy
engine holds, an idle one holds none.

Ray gives each worker a share of a node's CPUs (`num_cpus`, fractional so that a prefill and a decode
worker fit on 2 cores) and sets its OMP_NUM_THREADS to that share, at least 1: on a 2-core host a
decode worker then computes on one core while the other idles whenever the prefill worker has no
prompt, which is most of a decode-heavy run. More threads than that, fixed, oversubscribe the cores
while both are busy, and torch's intra-op threads then wait for each other at every op (a step
runs several times slower while another process holds one of its cores: docs/performance.md). So the threads
follow the load: before each step a busy worker claims its own share plus every core no other busy
worker claims, and an idle one withdraws its claim.

The claims are a small JSON file (pid -> threads) in /dev/shm, read and written under `flock`: a
claim of a process that died is dropped by the next reader. A busy worker that lost cores to one that
just woke keeps them at most one step (it claims again before the next); the one waking never waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

CLAIMS_FILE = "pdserve-cores.json"


def claims_path() -> Path:
    """Where this host's workers keep their claims: shared memory where there is some."""
    shared = Path("/dev/shm")
    return (shared if shared.is_dir() else Path(tempfile.gettempdir())) / CLAIMS_FILE


class NodeCores:
    """One worker's view of its host's cores: `busy()` before a step returns the threads to run it
    on (and sets them through `apply`), `idle()` when it has nothing to run."""

    def __init__(self, total: int, own: int, path: Path | None = None,
                 apply: Callable[[int], None] | None = None, pid: int | None = None) -> None:
        self.total = max(1, total)  # the cores the workers of this host share
        self.own = max(1, min(own, self.total))  # this worker's share: it always runs on at least these
        self.path = path or claims_path()
        self.apply = apply or _set_torch_threads
        self.pid = pid if pid is not None else os.getpid()
        self.threads = 0  # what `apply` was last given; 0: not yet

    def busy(self) -> int:
        with self._claims() as claims:
            others = sum(threads for pid, threads in claims.items() if pid != self.pid)
            threads = max(self.own, self.total - others)
            claims[self.pid] = threads
        if threads != self.threads:
            self.apply(threads)
            self.threads = threads
        return threads

    def idle(self) -> None:
        with self._claims() as claims:
            claims.pop(self.pid, None)

    @contextlib.contextmanager
    def _claims(self) -> Iterator[dict[int, int]]:
        """The live claims, under the file's lock; what the block leaves in the dict is written back."""
        with open(self.path, "a+", encoding="utf-8") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            file.seek(0)
            claims = {pid: threads for pid, threads in _parse(file.read()).items() if pid == self.pid or _alive(pid)}
            yield claims
            file.seek(0)
            file.truncate()
            file.write(json.dumps({str(pid): threads for pid, threads in claims.items()}))


def _parse(text: str) -> dict[int, int]:
    try:
        return {int(pid): int(threads) for pid, threads in json.loads(text or "{}").items()}
    except (ValueError, AttributeError):  # a file some other program wrote: start over
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _set_torch_threads(threads: int) -> None:
    """torch's threads for the calling thread's ops (OpenMP's count is per thread: call it on the engine's)."""
    import torch

    torch.set_num_threads(threads)


def host_cores(ray_cpus: float) -> int:
    """The cores a host's workers share: Ray's CPUs of the node, at most its physical cores (a second
    hyperthread of a core adds little to matmuls and costs every op a wait)."""
    import torch

    physical = int(torch.cpu.get_capabilities().get("num_physical_cores") or os.cpu_count() or 1)
    return max(1, min(int(ray_cpus), physical))
