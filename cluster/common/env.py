"""The environment variables pdserve reads: deployment settings only, each named once here."""

from __future__ import annotations

API_KEY = "PDSERVE_API_KEY"  # the key the front doors require, and the clients send
REDIS_URL = "PDSERVE_REDIS_URL"  # the shared state (routers, workers, rate limits)
CACHE_DIR = "PDSERVE_CACHE_DIR"  # where converted models are cached (default ~/.cache/pdserve)
# "1": a GPU worker stages its KV through pinned host buffers even where UCX could send device memory
KV_VIA_HOST = "PDSERVE_KV_VIA_HOST"
