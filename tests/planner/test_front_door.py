"""The front door's CPU read from /proc, on real processes: a child that burns known CPU seconds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.planner.front_door import CpuMeter, process_tree

# Burns 0.1 CPU-s on a second thread and 0.4 on its main thread between "go" and "done", then waits.
CHILD = """
import sys, threading, time
def spin(seconds, then=None):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    if then is not None:
        spun.set()
        then.wait()  # alive until the last sample: an ended thread's CPU is not in /proc any more
print("ready", flush=True)
sys.stdin.readline()
spun, ending = threading.Event(), threading.Event()
helper = threading.Thread(target=spin, args=(0.1, ending))
helper.start()
spin(0.4)
spun.wait()
print("done", flush=True)
sys.stdin.readline()
ending.set()
"""


@pytest.mark.parametrize("title, engine, front_door", [("WorkerActor", 0.4, 0.1), ("Router", 0.0, 0.5)])
def test_a_workers_busiest_thread_is_its_engine_and_the_rest_is_the_front_doors(title, engine, front_door):
    # In a process titled as a worker, the thread that used the most CPU in the window is its engine
    # thread; everything else, and every thread of any other process, is the front door's.
    child = subprocess.Popen([sys.executable, "-c", CHILD, title], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        meter = CpuMeter(root=child.pid)
        assert process_tree(child.pid) == [child.pid]
        before = meter.sample()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        measured = meter.window(before, meter.sample())
        child.stdin.write("end\n")
        child.stdin.flush()
    finally:
        child.wait(10)
    assert measured == pytest.approx((front_door, engine), abs=0.06)
