"""The chained block hashes that workers' prefix caches, the shared state and the routers all key by."""

from __future__ import annotations

from cluster.common.block_hashes import prefix_hashes

PROMPT = list(range(1, 10))  # 2 full blocks of 4, then one token


def test_two_models_never_share_a_cached_block() -> None:
    """Workers of two models publish to one index: the same tokens must name different blocks."""
    first, second = prefix_hashes(PROMPT, 4, "model-a"), prefix_hashes(PROMPT, 4, "model-b")
    assert len(first) == len(second) == 2
    assert not set(first) & set(second)
    assert prefix_hashes(PROMPT, 4, "model-a") == first


def test_the_hash_values_do_not_change_between_versions() -> None:
    """The hashes are shared state, not a private detail: Redis keeps the ones workers published, and
    during a rolling upgrade routers and workers of two versions compare them. A change to the
    values (byte order, widths, the root) must be a deliberate format change, so they are pinned."""
    assert prefix_hashes(PROMPT, 4, "m") == [990175925130322550, 9079003727188622381]
    assert prefix_hashes(PROMPT, 4) == [13813894423729059238, 2078423984701969388]
