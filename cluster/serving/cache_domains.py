"""Which requests may share prefix-cache blocks: the cache domain a front door gives each request.

A request finds cached only the blocks of requests of its own domain (the root of its block hashes,
`cluster.common.block_hashes`), so `cached_tokens` and the time to its first token tell a caller
about its own domain's requests only. The domain is made of:

- the request's `cache_salt` (vLLM's, both doors): requests share blocks only with requests of the
  same salt, so a salt known only to a group of users keeps everyone else's requests from finding
  (or timing) theirs;
- under `per-key` isolation (`--prefix-cache-isolation`, the default), the API key's tenant: two
  tenants never share blocks, whatever they send. `shared` lets every key share the cache (salts
  still partition it), for tenants that trust each other and share long prompts. Without API keys
  there is no tenant: one domain per salt.

Light: the front doors import it.
"""

from __future__ import annotations

import json

from cluster.serving.api_keys import Tenant

SHARED, PER_KEY = "shared", "per-key"
ISOLATIONS = (SHARED, PER_KEY)
DEFAULT_ISOLATION = PER_KEY
MAX_CACHE_SALT_BYTES = 256  # a salt names a domain; more bytes buy no more secrecy


def check_isolation(isolation: str) -> str:
    if isolation not in ISOLATIONS:
        raise ValueError(f"prefix cache isolation must be one of {', '.join(ISOLATIONS)}, not {isolation!r}")
    return isolation


def check_cache_salt(salt: object) -> str | None:
    """`salt` if it is None or a non-empty string of at most MAX_CACHE_SALT_BYTES UTF-8 bytes (as
    vLLM, which refuses an empty one); ValueError otherwise."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError("cache_salt must be a non-empty string")
    if len(salt.encode("utf-8", "surrogatepass")) > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes (UTF-8)")
    return salt


def cache_domain(isolation: str, tenant: Tenant | None, cache_salt: str | None) -> str:
    """The domain of a request with this salt from this tenant (None: no API key); "" is the
    model's shared domain. JSON with both parts named, so a salt can never spell a tenant's domain."""
    tenant_name = tenant.name if tenant is not None and isolation == PER_KEY else None
    if tenant_name is None and cache_salt is None:
        return ""
    return json.dumps({"salt": cache_salt, "tenant": tenant_name}, sort_keys=True, ensure_ascii=False)
