"""Errors that callers must tell apart, wherever they are raised: the front doors map them to status
codes (HTTP and gRPC), and Ray hands them across the process boundary as they are.

`ValueError` (a request that can never run: 400) needs no class of its own."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting_requests`: the caller should retry later (429)."""


class NoCapacityError(RuntimeError):
    """No decode worker could take the request now (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""


class ServiceUnavailable(RuntimeError):
    """The service is starting, draining or stopped: try again later (HTTP 503, gRPC UNAVAILABLE)."""


class ModelLoadError(ValueError):
    """The model files are missing, malformed or of a kind we cannot serve; the message says which."""


def missing_package(package: str, feature: str, install: str | None = None) -> ImportError:
    """The error for `feature` used where its optional `package` is not installed: the engine core runs
    with torch alone, and each optional part imports its package only when it is used."""
    return ImportError(f"{feature} needs the Python package {package!r}, which is not installed here "
                       f"(pip install {install or package})", name=package)
