"""The environment variables pdserve reads: deployment settings only, each named once here."""

from __future__ import annotations

API_KEY = "PDSERVE_API_KEY"  # the key the front doors require, and the clients send
REDIS_URL = "PDSERVE_REDIS_URL"  # the shared state (routers, workers, rate limits)
CACHE_DIR = "PDSERVE_CACHE_DIR"  # where converted models are cached (default ~/.cache/pdserve)
# "1": a GPU worker stages its KV through pinned host buffers even where UCX could send device memory
KV_VIA_HOST = "PDSERVE_KV_VIA_HOST"
# "1": an embedded Ray may start without token authentication (RAY_AUTH_MODE=disabled), open to whoever
# reaches its ports; without it pdserve refuses to start one so.
ALLOW_OPEN_RAY = "PDSERVE_ALLOW_OPEN_RAY"
