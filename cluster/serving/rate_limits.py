"""Per-tenant rate limits and token quotas, kept in the shared state so every gateway replica
counts against the same buckets (Redis; or this process alone without it). A tenant is an API key's
(cluster.serving.api_keys), with its own limits or the server's; without keys, a client address.

Two token buckets per key: requests per second (burst: one second's worth, at least 1) and tokens
per minute, where a request costs its prompt plus its max_tokens (burst: one minute's worth). A
request over either limit is refused with 429 and a Retry-After of the time until it would fit;
one that could never fit the per-minute quota with 400. Requests that generate nothing (/tokenize,
/detokenize) count against the requests bucket only (`check_request`). The front doors take a
request from its bucket before any work for it (tokenizing, templating, compiling a grammar) and its
tokens once it is tokenized: a tenant over its limit costs the shared pool nothing.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cluster.serving.api_keys import Tenant
from cluster.state.interface import SharedState


class RateLimited(RuntimeError):
    """Over the key's limit now: retry after `retry_after_s` (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class RateLimits:
    state: SharedState
    requests_per_s: float = 0.0  # 0: no limit
    tokens_per_min: float = 0.0  # 0: no quota

    @property
    def enabled(self) -> bool:
        return self.requests_per_s > 0 or self.tokens_per_min > 0

    def for_tenant(self, tenant: Tenant | None) -> RateLimits:
        """These limits with the tenant's own where its key sets them."""
        if tenant is None:
            return self
        return dataclasses.replace(
            self, requests_per_s=self.requests_per_s if tenant.requests_per_s is None else tenant.requests_per_s,
            tokens_per_min=self.tokens_per_min if tenant.tokens_per_min is None else tenant.tokens_per_min)

    async def check_tokens(self, key: str, tokens: int) -> None:
        """Take `tokens` from `key`'s tokens bucket, or raise RateLimited / ValueError (more than the
        quota holds). The front doors take the request first, before tokenizing, then its tokens."""
        if self.tokens_per_min > 0:
            decision = await self.state.take(f"tpm:{key}", tokens, self.tokens_per_min / 60, self.tokens_per_min)
            if math.isinf(decision.retry_after_s):
                raise ValueError(f"the request needs {tokens} tokens (prompt + max_tokens), more than this key's "
                                 f"quota of {self.tokens_per_min:g} per minute")
            if not decision.allowed:
                raise RateLimited(f"over {self.tokens_per_min:g} tokens per minute for this key",
                                  decision.retry_after_s)

    async def check_request(self, key: str) -> None:
        """Take one request from `key`'s requests bucket (none of its tokens), or raise RateLimited."""
        if self.requests_per_s > 0:
            decision = await self.state.take(f"rps:{key}", 1, self.requests_per_s, max(1.0, self.requests_per_s))
            if not decision.allowed:
                raise RateLimited(f"over {self.requests_per_s:g} requests per second for this key",
                                  decision.retry_after_s)
