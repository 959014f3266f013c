"""The private local Ray's temporary directory (`init_ray`) goes when Ray stops or the process ends."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import os
from cluster.ray_cluster import launcher
launcher.init_ray()
first = launcher._temp_dir
assert os.path.isdir(first)
launcher.shutdown_ray()
print(first, os.path.exists(first))
launcher.init_ray()
kept = launcher._temp_dir
launcher.shutdown_ray(keep_logs=True)
print(kept)
launcher.init_ray()
print(launcher._temp_dir)  # this process ends with Ray running: the exit hook removes it
"""


def test_ray_temporary_directories_go_with_ray_or_the_process_unless_kept() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    stopped, kept, at_exit = done.stdout.split("\n")[-4:-1]
    assert stopped.endswith(" False"), stopped  # shutdown_ray removed it
    try:
        assert Path(kept).is_dir() and (Path(kept) / "session_latest").exists()  # keep_logs: Ray's logs stay
        assert not Path(at_exit).exists()
    finally:
        subprocess.run(["rm", "-rf", kept], check=False)
