"""The environment a process hosting an engine starts with: glibc's malloc kept from handing a step's
memory back to the kernel, only to fault it back in at the next step.

A worker runs its engine on a thread of its own (`cluster.worker.worker`), and glibc gives a new
thread an arena of its own: heaps of at most 64 MiB mapped apart from the main one, shrunk
(`madvise(DONTNEED)`) or unmapped as soon as enough of their top is free. A step over a batch of
prompts allocates and frees tens of MiB per layer, so on such a thread the steps fault their memory
back in page by page: four 2,048-token steps of the default model faulted 290,000 pages on a thread
(1.2 GB zeroed, plus a kernel thread's RCU frees), against a few thousand with these settings
(`python -m benchmarks.malloc_arenas`, docs/performance.md). The settings: one arena (the engine
thread allocates from the main heap, as an engine on the main thread does), a top never trimmed,
and a fixed mmap threshold of 32 MiB (glibc's largest: smaller blocks come from the heap and stay;
setting the trim threshold alone would turn off the threshold's own growth and send every block
over 128 KiB to mmap). The heap then keeps its peak, one step's working set, as the engine alone's
does. glibc reads them once, when the process starts: they go into the environment Ray starts a
worker's process with.
"""

from __future__ import annotations

import os

# glibc's names (its tunables glibc.malloc.arena_max, trim_threshold, mmap_threshold).
ENGINE_PROCESS_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
}


def engine_process_env() -> dict[str, str]:
    """Environment variables for a process that runs an engine off its main thread. An operator who
    set any of them in the launching environment keeps that value."""
    return {name: os.environ.get(name) or value for name, value in ENGINE_PROCESS_ENV.items()}
