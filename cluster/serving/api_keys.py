"""Who a request comes from: the API keys a deployment accepts, each naming a tenant.

A tenant is what both front doors count and scope by: its own rate-limit buckets (with its own
limits, or the server's), its own space of client request ids (a gRPC Abort reaches only the
tenant's requests). Keys come from `--api-key` (one tenant, "default") and/or a keys file
(`--api-keys-file`, e.g. a mounted Kubernetes Secret), YAML or JSON:

    keys:
      - name: team-a                 # unique; what logs, metrics and buckets say
        key: sk-team-a-...           # unique; sent as `Authorization: Bearer <key>`
        rate_limit_rps: 5            # optional: this tenant's limits instead of the server's
        rate_limit_tpm: 200000

With no key at all the API is open and requests are counted by client address (never by a bearer a
client could change per request). This module is light: the front doors import it.
"""

from __future__ import annotations

import hmac
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    requests_per_s: float | None = None  # None: the server's --rate-limit-rps
    tokens_per_min: float | None = None  # None: the server's --rate-limit-tpm


class ApiKeys:
    """The keys accepted, each to its tenant; `enabled` once there is one."""

    def __init__(self, tenants_by_key: dict[str, Tenant] | None = None) -> None:
        self._by_key = {key.encode(): tenant for key, tenant in (tenants_by_key or {}).items()}

    @property
    def enabled(self) -> bool:
        return bool(self._by_key)

    @property
    def tenants(self) -> list[Tenant]:
        return list(self._by_key.values())

    @classmethod
    def of(cls, api_key: str | None = None, path: str | Path | None = None) -> ApiKeys:
        """The single `api_key` (tenant "default") and the keys of the file at `path`, either or both."""
        entries = [{"name": DEFAULT_TENANT, "key": api_key}] if api_key else []
        if path:
            entries += _entries_of(yaml.safe_load(Path(path).read_text()), str(path))
        return cls.from_entries(entries)

    @classmethod
    def from_entries(cls, entries: list[dict[str, Any]]) -> ApiKeys:
        """Keys from `{"name", "key", "rate_limit_rps"?, "rate_limit_tpm"?}` entries; ValueError if a
        name or key repeats, or a field is missing or of the wrong kind."""
        tenants: dict[str, Tenant] = {}
        names: set[str] = set()
        for index, entry in enumerate(entries):
            name, key = entry.get("name"), entry.get("key")
            if not isinstance(name, str) or not name or not isinstance(key, str) or not key:
                raise ValueError(f"API key entry {index}: needs a non-empty 'name' and 'key'")
            if name in names or key in tenants:
                raise ValueError(f"API key entry {index} ({name}): its name or key is already used by another")
            if unknown := set(entry) - {"name", "key", "rate_limit_rps", "rate_limit_tpm"}:
                raise ValueError(f"API key entry {index} ({name}): unknown fields {sorted(unknown)}")
            names.add(name)
            tenants[key] = Tenant(name, _rate(entry, "rate_limit_rps", name), _rate(entry, "rate_limit_tpm", name))
        return cls(tenants)

    def tenant_of(self, authorization: str | bytes | None) -> Tenant | None:
        """The tenant whose key an `Authorization` value (`Bearer <key>`) carries, else None. Every key
        is compared, each in constant time: the time taken tells nothing about a guessed key."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, given = (authorization or "").partition(" ")
        candidate = given.strip().encode("latin-1", "replace")
        found = None
        for key, tenant in self._by_key.items():
            if hmac.compare_digest(candidate, key) and scheme.lower() == "bearer":
                found = tenant
        return found


def _entries_of(document: Any, where: str) -> list[dict[str, Any]]:
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError(f"{where}: expected a mapping with a 'keys' list of entries (see docs/security.md)")
    return entries


def _rate(entry: dict[str, Any], field: str, name: str) -> float | None:
    value = entry.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"API key {name}: {field} must be a number >= 0, not {value!r}")
    return float(value)
