"""The chained block hashes that workers' prefix caches, the shared state and the routers all key by."""

from __future__ import annotations

import hashlib
from array import array

from cluster.common.block_hashes import HASH_BYTES, hash_block_tokens, prefix_hashes, root_hash

PROMPT = list(range(1, 10))  # 2 full blocks of 4, then one token


def test_two_models_never_share_a_cached_block() -> None:
    """Workers of two models publish to one index: the same tokens must name different blocks."""
    first, second = prefix_hashes(PROMPT, 4, "model-a"), prefix_hashes(PROMPT, 4, "model-b")
    assert len(first) == len(second) == 2
    assert not set(first) & set(second)
    assert prefix_hashes(PROMPT, 4, "model-a") == first


def test_a_block_hash_is_sha256_of_its_parent_and_tokens_cut_to_128_bits() -> None:
    """A 64-bit unkeyed hash can be collided offline in about 2**32 work, planting one prompt's KV
    under another's; SHA-256 cut to 128 bits leaves 2**64 for a collision, 2**128 for a second preimage."""
    parent = root_hash("m")
    expected = hashlib.sha256(parent.to_bytes(16, "little") + array("q", [5, 6, 7, 8]).tobytes()).digest()[:16]
    assert HASH_BYTES == 16
    assert hash_block_tokens(parent, [5, 6, 7, 8]) == int.from_bytes(expected, "little")
    hashes = prefix_hashes(list(range(4 * 64)), 4, "m")
    assert all(0 <= h < 2**128 for h in hashes)
    assert max(hashes) >= 2**120  # the full width is used, not 64 bits of it


def test_a_cache_domain_changes_every_hash_of_the_chain() -> None:
    """Requests of two domains (tenants, salts) must never find each other's blocks: no block hash
    of one chain may appear in the other, however long the shared prompt."""
    prompt = list(range(100, 100 + 4 * 16))
    shared, tenant_a, tenant_b = (prefix_hashes(prompt, 4, "m", domain) for domain in ("", "a", "b"))
    assert len(shared) == len(tenant_a) == len(tenant_b) == 16
    assert not set(shared) & set(tenant_a) and not set(tenant_a) & set(tenant_b) and not set(shared) & set(tenant_b)
    assert prefix_hashes(prompt, 4, "m", "a") == tenant_a  # one domain: the same chain every time


def test_the_root_keeps_the_model_name_and_the_domain_apart() -> None:
    """Length-prefixed parts: a model "ab" with domain "c" is not model "a" with domain "bc"."""
    assert root_hash("ab", "c") != root_hash("a", "bc")
    assert root_hash("m") == root_hash("m", "")
    assert root_hash("m", "") != root_hash("m", "\0")


def test_the_hash_values_do_not_change_between_versions() -> None:
    """The hashes are shared state, not a private detail: Redis keeps the ones workers published, and
    during a rolling upgrade routers and workers of two versions compare them. A change to the
    values (byte order, widths, the root) must be a deliberate format change, so they are pinned."""
    assert prefix_hashes(PROMPT, 4, "m") == PINNED_MODEL_M
    assert prefix_hashes(PROMPT, 4) == PINNED_UNNAMED


PINNED_MODEL_M = [203702504849019078724162375839140475789, 321172963158797956449205481688557938146]
PINNED_UNNAMED = [66797552274830813401858529090101185432, 40798169522823296102313100723608369658]
