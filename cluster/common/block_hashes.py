"""The chained hashes that name a full KV block by its tokens and every token before it.

Workers' prefix caches key blocks by them, workers publish them to the shared state, and routers
hash prompts the same way to find the worker that caches the longest prefix. Stable across
processes (unlike `hash()` of a str)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block_tokens(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """A stable 64-bit hash of one full block chained over every block before it.

    Stable across processes (unlike `hash()` of a str), so workers can publish it to a shared index.
    """
    digest = hashlib.blake2b(parent_hash.to_bytes(8, "little"), digest_size=8)
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def model_root_hash(model_name: str) -> int:
    """The hash every chain starts from, so two models never share blocks."""
    return int.from_bytes(hashlib.blake2b(model_name.encode(), digest_size=8).digest(), "little")


def prefix_hashes(prompt: Sequence[int], block_size: int, model_name: str = "") -> list[int]:
    """One chained hash per full block of the prompt, the very hashes the workers' prefix caches use
    (`cluster.engine.kv_cache_manager`): equal hashes mean equal prefixes up to there."""
    hashes, parent = [], model_root_hash(model_name)
    for start in range(0, len(prompt) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, list(prompt[start:start + block_size]))
        hashes.append(parent)
    return hashes

