from __future__ import annotations

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.block_pool import BlockPool
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.request import Request, RequestStatus


def test_allocate_and_free_returns_every_block() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert pool.num_free_blocks == 3
    assert all(block.ref_count == 1 for block in blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 8


def test_allocating_more_than_free_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="only 2 free"):
        pool.allocate(3)


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed more times"):
        pool.free(blocks)


def test_cached_block_survives_free_until_evicted() -> None:
    pool = BlockPool(2)
    block = pool.allocate(1)[0]
    pool.cache(block, 1234)
    pool.free([block])
    assert pool.lookup(1234) is block
    pool.touch([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    pool.free([block])
    pool.allocate(2)  # needs every block: the cached one is evicted
    assert pool.lookup(1234) is None


def test_eviction_is_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    pool.cache(first, 1)
    pool.cache(second, 2)
    pool.free([second])
    pool.free([first])
    pool.allocate(2)  # the empty block, then the least recently freed cached one
    assert pool.lookup(2) is None and pool.lookup(1) is first


def test_request_frees_tail_first_so_prefix_outlives_tail() -> None:
    pool = BlockPool(2)
    head, tail = pool.allocate(2)
    pool.cache(head, 10)
    pool.cache(tail, 11)
    pool.free([head, tail])
    pool.allocate(1)
    assert pool.lookup(10) is head and pool.lookup(11) is None


def test_disabled_prefix_caching_caches_nothing() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    block = pool.allocate(1)[0]
    pool.cache(block, 5)
    assert pool.lookup(5) is None


def test_an_unknown_request_has_an_empty_block_table() -> None:
    manager = KVCacheManager(BlockPool(4), 4)
    assert manager.block_ids("nobody") == []


def test_a_pool_of_one_block_serves_and_an_empty_pool_is_refused() -> None:
    pool = BlockPool(1)
    (block,) = pool.allocate(1)
    assert pool.num_free_blocks == 0
    pool.free([block])
    assert pool.num_free_blocks == 1
    with pytest.raises(ValueError, match="at least one block, got 0"):
        BlockPool(0)


def test_eviction_is_reported_with_the_hash_that_left_the_cache() -> None:
    """Routers learn from these events which prefixes a worker still holds: an eviction must name it."""
    pool = BlockPool(1)
    pool.record_events()
    block = pool.allocate(1)[0]
    pool.cache(block, 1234)
    pool.free([block])
    pool.allocate(1)  # the only block: its cached prefix is evicted
    events = pool.take_events()
    assert (events.stored, events.evicted) == ([1234], [1234])


def test_a_block_reused_after_eviction_can_be_cached_again() -> None:
    """Eviction must leave the block as good as new, or it could never hold a cached prefix again."""
    pool = BlockPool(1)
    block = pool.allocate(1)[0]
    pool.cache(block, 1)
    pool.free([block])
    assert pool.allocate(1) == [block]  # evicts hash 1
    pool.cache(block, 2)
    assert pool.lookup(1) is None and pool.lookup(2) is block


def test_a_copy_of_a_cached_block_stays_private_even_once_the_first_is_evicted() -> None:
    """First writer wins: a block another request filled with the same prefix is offered to the
    cache once, when it fills, and never again: the cache announces each block it takes once."""
    pool = BlockPool(8)
    pool.record_events()
    manager = KVCacheManager(pool, 4)
    tokens = list(range(1, 10))
    first, second = (Request(name, tokens, SamplingParams(max_tokens=1)) for name in ("first", "second"))
    manager.allocate_slots(first, 4)
    manager.allocate_slots(second, 4)  # the same first block, computed again: second's copy is private
    first.status = RequestStatus.FINISHED_STOPPED
    manager.free(first)
    pool.reset_prefix_cache()  # first's copy, now unowned, leaves the cache
    second.num_computed_tokens = 4
    manager.allocate_slots(second, 4)  # second fills its next block
    head, next_block = manager.hashes_of["second"]
    events = pool.take_events()
    assert (events.stored, events.evicted) == ([head, next_block], [head])
    assert pool.lookup(head) is None
