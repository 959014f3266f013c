"""An embedded Ray without token authentication is open to whoever reaches its ports (they could run
code on it): pdserve refuses to start one unless told PDSERVE_ALLOW_OPEN_RAY=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_embedded_ray_without_token_authentication_is_refused() -> None:
    environment = {key: value for key, value in os.environ.items() if not key.startswith(("RAY_AUTH", "PDSERVE_"))}
    script = "from cluster.ray_cluster.launcher import init_ray; init_ray()"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**environment, "RAY_AUTH_MODE": "disabled"})
    assert done.returncode != 0
    assert "RAY_AUTH_MODE=disabled would start the embedded Ray open" in done.stderr
    assert "PDSERVE_ALLOW_OPEN_RAY=1" in done.stderr
