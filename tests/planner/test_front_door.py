"""The front door's CPU read from /proc, on real processes: a child that burns known CPU seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cluster.planner.front_door import (
    CpuMeter,
    OtherLoad,
    cores_between,
    machine_busy_s,
    process_tree,
)

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


SPIN = """
import time
end = time.thread_time() + 0.4
while time.thread_time() < end:
    pass
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


def test_other_processes_cores_count_a_process_outside_the_tree():
    # The tree: an idle child (it waits for "go"). Outside it: another child burning 0.4 CPU-s. The
    # other load over that window holds those 0.4 s (other jobs on the host may only add to it).
    idle = subprocess.Popen([sys.executable, "-c", CHILD, "Router"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert idle.stdout is not None and idle.stdin is not None
        assert idle.stdout.readline().strip() == "ready"
        load = OtherLoad(root=idle.pid)
        assert load.pids == [idle.pid]
        load.sample(time.perf_counter())
        subprocess.run([sys.executable, "-c", SPIN], check=True, timeout=30)
        load.sample(time.perf_counter())
    finally:
        idle.kill()
        idle.wait(10)
    ((start, end, cores),) = load.timeline()
    assert cores * (end - start) >= 0.4 - 0.06
    assert cores <= (os.cpu_count() or 1) + 0.1
    assert machine_busy_s() > 0


def test_cores_between_is_the_time_weighted_mean_over_the_window():
    # 0.5 core over [0, 1], 1.5 over [1, 2]: [0.5, 1.5] is half of each, 1.0; [1.5, 3] covers only 1.5-2.
    timeline = [(0.0, 1.0, 0.5), (1.0, 2.0, 1.5)]
    assert cores_between(timeline, 0.5, 1.5) == pytest.approx(1.0)
    assert cores_between(timeline, 0.25, 1.0) == pytest.approx(0.5)
    assert cores_between(timeline, 1.5, 3.0) == pytest.approx(1.5)
    assert cores_between(timeline, 5.0, 6.0) == 0.0
