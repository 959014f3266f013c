"""The host KV tier: blocks the device pool evicts move to host memory and come back on a prefix hit.

The scheduler-level tests replace the model by a runner that tracks which prefix each device block
and host slot holds (a full block's chained hash), makes the step's copies in the runner's order,
and checks that every block a request reads holds its own prefix: an eviction that copies nothing,
or a promotion that loads nothing (or the wrong slot), shows as a block holding another prefix.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.common.block_hashes import hash_block_tokens, root_hash
from cluster.common.sampling_params import SamplingParams
from cluster.engine.block_pool import BlockPool
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.host_tier import HostTier
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.request import Request
from cluster.engine.scheduler import Scheduler
from cluster.engine.scheduler_output import SchedulerOutput
from tests.engine.test_engine_outputs import checkpoint  # noqa: F401  (the module fixture)
from tests.helpers import fp32_model

BLOCK_SIZE = 4


class ContentRunner:
    """Stands in for the model runner: what each device block and host slot holds, as the chained
    hash of the prefix written there (None: unknown, e.g. a partly written block)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.device: dict[int, int | None] = {}
        self.host: dict[int, int | None] = {}
        self.swapped: dict[str, list[int | None]] = {}

    def execute(self, output: SchedulerOutput) -> None:
        """The copies in the runner's order (reads of old KV, then writes into new blocks), then the step."""
        copies = output.host_copies
        for block_id, slot in zip(copies.offload_blocks, copies.offload_slots, strict=True):
            self.host[slot] = self.device.get(block_id)
        for order in output.swap_out:
            self.swapped[order.request_id] = [self.device.get(block_id) for block_id in order.block_ids]
        for slot, block_id in zip(copies.load_slots, copies.load_blocks, strict=True):
            self.device[block_id] = self.host.get(slot)
        for order in output.swap_in:
            for block_id, content in zip(order.block_ids, self.swapped.pop(order.request_id), strict=True):
                self.device[block_id] = content
        for scheduled in output.scheduled:
            request, block_ids = scheduled.request, scheduled.block_ids
            expected = prefix_hashes(request)
            computed = request.num_computed_tokens
            for index in range(computed // BLOCK_SIZE):  # what attention reads: the request's own prefix
                assert self.device[block_ids[index]] == expected[index], \
                    f"{request.request_id} reads block {block_ids[index]} holding another prefix"
            for index in range(computed // BLOCK_SIZE, (computed + scheduled.num_new_tokens) // BLOCK_SIZE):
                self.device[block_ids[index]] = expected[index]
            if (computed + scheduled.num_new_tokens) % BLOCK_SIZE:  # a partly written block: unknown content
                self.device[block_ids[(computed + scheduled.num_new_tokens) // BLOCK_SIZE]] = None


def prefix_hashes(request: Request) -> list[int]:
    """The chained hash of each full block of the request's tokens, computed apart from the engine."""
    tokens, parent, hashes = request.all_token_ids, root_hash("", request.sampling_params.cache_domain), []
    for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash_block_tokens(parent, tokens[start:start + BLOCK_SIZE])
        hashes.append(parent)
    return hashes


def make_scheduler(num_blocks: int, num_host_blocks: int, **config: object) -> Scheduler:
    pool = BlockPool(num_blocks, host_tier=HostTier(num_host_blocks))
    pool.record_events()
    return Scheduler(SchedulerConfig(**config), KVCacheManager(pool, BLOCK_SIZE),  # type: ignore[arg-type]
                     num_blocks * BLOCK_SIZE, num_swap_blocks=num_blocks)


def make_request(request_id: str, prefix: int, prompt_len: int, max_tokens: int) -> Request:
    """Prompts of one `prefix` share their start: few prefixes, so they evict and hit each other."""
    prompt = [1 + prefix * 50 + i for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), eos_token_ids=(0,))


def assert_tiers_consistent(scheduler: Scheduler, runner: ContentRunner, index: set[int]) -> None:
    """No block or slot leaks, each hash in one place, its KV where its hash says; the router's view
    (the events applied as the index applies them) is what the worker holds."""
    pool = scheduler.kv_cache.pool
    tier = pool.host_tier
    assert tier is not None
    owned = [block for blocks in scheduler.kv_cache.blocks_of.values() for block in blocks]
    in_use = {block.block_id for block in owned}
    assert all(block.ref_count > 0 for block in owned)
    assert len(in_use) + pool.num_free_blocks == pool.num_blocks, "a device block leaked"
    assert not in_use & set(pool.free_queue), "a block is both owned and free"
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash and runner.device.get(block.block_id) == block_hash
    slots = list(tier.slot_of.values())
    assert len(set(slots)) == len(slots), "two hashes share a host slot"
    assert sorted(slots + tier.free_slots + tier.released) == list(range(tier.num_slots)), "a host slot leaked"
    for block_hash, slot in tier.slot_of.items():
        assert runner.host.get(slot) == block_hash, f"host slot {slot} does not hold the KV of its hash"
    events = pool.take_events()
    index.update(events.stored)
    index.difference_update(events.evicted)
    assert index == set(pool.held_hashes())


def step(scheduler: Scheduler, runner: ContentRunner, rng: random.Random) -> None:
    output = scheduler.schedule()
    runner.execute(output)
    scheduler.update_from_output(output, {s.request.request_id: [rng.randrange(1, 50)]
                                          for s in output.scheduled if s.samples})


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 30), st.integers(1, 8)),
        st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0)),
    ),
    min_size=1, max_size=80)


@settings(max_examples=80, deadline=None)
@given(operations, st.sampled_from(["recompute", "swap"]), st.integers(8, 24), st.integers(1, 16),
       st.integers(4, 48))
def test_no_block_leaks_and_every_read_finds_its_own_prefix(ops: list[tuple[str, int, int, int]], mode: str,
                                                           num_blocks: int, num_host_blocks: int,
                                                           budget: int) -> None:
    """Random adds (few shared prefixes), steps and aborts over a small pool: evictions into the tier,
    promotions out of it, preemptions by swap or recompute, all in the same steps."""
    run_traffic(ops, mode, num_blocks, num_host_blocks, budget)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_long_random_traffic_promotes_often_and_stays_consistent(mode: str) -> None:
    """Hypothesis keeps its examples short: this runs long seeded ones, so promotions are many."""
    promoted = 0
    for seed in range(6):
        rng = random.Random(seed)
        ops = [rng.choice([("add", rng.randrange(4), rng.randrange(1, 30), rng.randrange(1, 8)),
                           ("step", 0, 0, 0), ("step", 0, 0, 0), ("abort", rng.randrange(30), 0, 0)])
               for _ in range(150)]
        promoted += run_traffic(ops, mode, num_blocks=12, num_host_blocks=rng.randrange(2, 16), budget=16).promoted
    assert promoted >= 50


def run_traffic(ops: list[tuple[str, int, int, int]], mode: str, num_blocks: int, num_host_blocks: int,
                budget: int) -> HostTier:
    """Run the operations, then everything to the end, checking the tiers after each; the tier."""
    scheduler = make_scheduler(num_blocks, num_host_blocks, preemption_mode=mode, max_num_batched_tokens=budget)
    runner, rng, index, ids = ContentRunner(scheduler), random.Random(0), set[int](), list[str]()
    for op, a, b, c in ops:
        if op == "add" and b + 1 < num_blocks * BLOCK_SIZE:
            ids.append(f"r{len(ids)}")
            scheduler.add_request(make_request(ids[-1], a, b, c))
        elif op == "abort" and ids:
            scheduler.abort(ids[a % len(ids)])
        elif op == "step":
            step(scheduler, runner, rng)
        assert_tiers_consistent(scheduler, runner, index)
    for _ in range(5_000):
        if not scheduler.num_unfinished:
            break
        step(scheduler, runner, rng)
        assert_tiers_consistent(scheduler, runner, index)
    assert not scheduler.num_unfinished
    assert scheduler.kv_cache.pool.num_free_blocks == num_blocks and not scheduler.kv_cache.blocks_of
    tier = scheduler.kv_cache.pool.host_tier
    assert tier is not None
    return tier


def test_a_prefix_evicted_from_the_pool_is_promoted_back_with_its_hits_counted() -> None:
    scheduler = make_scheduler(num_blocks=8, num_host_blocks=16)
    runner, rng = ContentRunner(scheduler), random.Random(0)
    tier = scheduler.kv_cache.pool.host_tier
    assert tier is not None
    for request_id, prefix in (("a", 0), ("b", 1), ("c", 2), ("again", 0)):  # b and c push a's blocks out
        scheduler.add_request(make_request(request_id, prefix, 17, 2))
        while scheduler.num_unfinished:
            step(scheduler, runner, rng)
    assert tier.offloaded > 0 and tier.promoted == 4  # a's 4 full prompt blocks came back
    assert tier.hits == 16 and scheduler.kv_cache.prefix_hits == 16
    assert_tiers_consistent(scheduler, runner, set(scheduler.kv_cache.pool.held_hashes()))


def test_the_tier_needs_prefix_caching_and_a_positive_size() -> None:
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        CacheConfig(enable_prefix_caching=False, num_host_kv_blocks=8)
    with pytest.raises(ValueError, match="host_kv_cache_gb must be > 0"):
        CacheConfig(host_kv_cache_gb=0)
    with pytest.raises(ValueError, match="at least one slot"):
        HostTier(0)


# ---- the whole engine, on a small random-weight model ---------------------------------------------

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# Eight prompts of 5 full blocks each (and a token), asked twice in turn: 48 blocks of working set
# over a pool of 16, so each prefix has left the pool by the time it comes back.
WORKLOAD = [[100 + 20 * prefix + i for i in range(5 * BLOCK_SIZE + 1)] for prefix in range(8)] * 2


def tier_engine(path: Path, num_blocks: int, num_host_kv_blocks: int = 0, disk_dir: str = "") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=fp32_model(path),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, num_host_kv_blocks=num_host_kv_blocks,
                          host_kv_disk_dir=disk_dir),
        scheduler=SchedulerConfig(max_num_seqs=2)))


def run_in_turn(engine: LLMEngine) -> tuple[list[list[int]], list[int]]:
    """Each prompt alone, in order: its tokens and its cached prompt tokens."""
    tokens, cached = [], []
    for prompt in WORKLOAD:
        (output,) = engine.generate([prompt], GREEDY)
        tokens.append(list(output.token_ids))
        cached.append(output.num_cached_tokens)
    return tokens, cached


def test_a_working_set_larger_than_the_pool_comes_back_from_host_memory_with_the_same_tokens(
        checkpoint: Path) -> None:  # noqa: F811
    reference, _ = run_in_turn(tier_engine(checkpoint, num_blocks=256))
    without, cached_without = run_in_turn(tier_engine(checkpoint, num_blocks=16))
    engine = tier_engine(checkpoint, num_blocks=16, num_host_kv_blocks=64)
    with_tier, cached_with = run_in_turn(engine)
    assert without == reference and with_tier == reference
    assert cached_without == [0] * 16  # the pool alone: every prefix gone by its second turn
    assert cached_with == [0] * 8 + [5 * BLOCK_SIZE] * 8  # the tier: every second turn's 5 blocks hit
    stats = engine.stats().host_kv
    assert stats is not None and stats.hits == 8 * 5 * BLOCK_SIZE and stats.promoted == 8 * 5
    pool = engine.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks and not engine.runner.swap_store


def test_the_tier_on_disk_gives_the_same_tokens_from_a_file_that_leaves_nothing_behind(
        checkpoint: Path, tmp_path: Path) -> None:  # noqa: F811
    """`host_kv_disk_dir`: the tier's slots in a memory-mapped file there, unlinked at once (no file is
    left behind, whichever way the process ends); the same hits and tokens as the tier in memory."""
    import os

    reference, _ = run_in_turn(tier_engine(checkpoint, num_blocks=256))
    engine = tier_engine(checkpoint, num_blocks=16, num_host_kv_blocks=64, disk_dir=str(tmp_path / "kv"))
    assert not os.listdir(tmp_path / "kv")
    host = engine.runner.host_kv
    assert host is not None
    maps = Path("/proc/self/maps").read_text()
    assert f"{tmp_path / 'kv'}/pdserve-host-kv-" in maps and "(deleted)" in maps  # the slots are the file's pages
    tokens, cached = run_in_turn(engine)
    assert tokens == reference and cached == [0] * 8 + [5 * BLOCK_SIZE] * 8
    with pytest.raises(ValueError, match="host_kv_disk_dir puts the host KV tier on disk"):
        CacheConfig(host_kv_disk_dir=str(tmp_path))
