"""The private local Ray's temporary directory (`init_ray`) goes when Ray stops or the process ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, os
from cluster.ray_cluster import launcher
registered, register = [], atexit.register
atexit.register = lambda hook, *args, **kwargs: registered.append(hook) or register(hook, *args, **kwargs)
launcher.init_ray()
kept = launcher._temp_dir
assert os.path.isdir(kept)
launcher.shutdown_ray(keep_logs=True)
print(kept)
launcher.init_ray()
print(launcher._temp_dir, launcher.shutdown_ray in registered)
"""


def test_ray_temporary_directories_go_with_ray_or_the_process_unless_kept() -> None:
    """Two starts of Ray (each takes seconds): one stopped with keep_logs, one left running when the
    process ends, where the exit hook (`shutdown_ray` itself, the tests' and `pdserve`'s plain stop)
    removes its directory."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    kept, at_exit = done.stdout.split("\n")[-3:-1]
    try:
        assert Path(kept).is_dir() and (Path(kept) / "session_latest").exists()  # keep_logs: Ray's logs stay
        directory, hook_is_shutdown = at_exit.split()
        assert hook_is_shutdown == "True"
        assert not Path(directory).exists()  # removed by shutdown_ray at exit
    finally:
        subprocess.run(["rm", "-rf", kept], check=False)
