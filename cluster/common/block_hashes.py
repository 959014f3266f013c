"""The chained hashes that name a full KV block by its tokens, every token before it, and its
cache domain.

Workers' prefix caches key blocks by them, workers publish them to the shared state, and routers
hash prompts the same way to find the worker that caches the longest prefix. Stable across
processes (unlike `hash()` of a str).

Each chain starts from a root over the model's name and the request's cache domain (its
`cache_salt` and, where the server isolates tenants, its API key's tenant: `cluster.serving.cache_domains`),
so requests of two domains never name the same block and never read each other's KV. The hashes are
SHA-256 cut to 128 bits: finding two prompts whose blocks collide (to plant one's KV in the other's
answer) takes about 2**64 work, and matching a given block 2**128.

    root = sha256("pdserve-kv-root" | len(model) model | len(domain) domain)[:16]
    block i = sha256(block i-1 (16 bytes, little-endian) | its token ids (8 bytes each))[:16]
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_BYTES = 16  # every hash is an int below 2**128: what Redis stores and the router compares
_ROOT_TAG = b"pdserve-kv-root"


def hash_block_tokens(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """The hash of one full block chained over every block before it (`parent_hash`)."""
    digest = hashlib.sha256(parent_hash.to_bytes(HASH_BYTES, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest()[:HASH_BYTES], "little")


def root_hash(model_name: str, cache_domain: str = "") -> int:
    """The hash every chain of the model and cache domain starts from: two models, or two domains,
    never share blocks. Each part is length-prefixed, so no two pairs read alike."""
    digest = hashlib.sha256(_ROOT_TAG)
    for part in (model_name, cache_domain):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little") + data)
    return int.from_bytes(digest.digest()[:HASH_BYTES], "little")


def prefix_hashes(prompt: Sequence[int], block_size: int, model_name: str = "", cache_domain: str = "") -> list[int]:
    """One chained hash per full block of the prompt, the very hashes the workers' prefix caches use
    (`cluster.engine.kv_cache_manager`) for requests of that cache domain: equal hashes mean equal
    prefixes, in one domain, up to there."""
    hashes, parent = [], root_hash(model_name, cache_domain)
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, list(prompt[start:start + block_size]))
        hashes.append(parent)
    return hashes
