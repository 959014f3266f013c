"""Scheduler and KV cache manager behaviour with the model replaced by a stub sampler."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.common.errors import QueueFullError
from cluster.common.sampling_params import SamplingParams
from cluster.engine.block_pool import BlockPool
from cluster.engine.config import SchedulerConfig
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import PARKED_S, Scheduler
from cluster.engine.scheduler_output import SchedulerOutput

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int = 64, max_model_len: int = 256, **config: object) -> Scheduler:
    kv_cache = KVCacheManager(BlockPool(num_blocks), BLOCK_SIZE)
    return Scheduler(SchedulerConfig(**config), kv_cache, max_model_len, num_swap_blocks=num_blocks)  # type: ignore[arg-type]


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4, priority: int = 0,
                 first_token: int = 1) -> Request:
    prompt = [first_token + i for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), eos_token_ids=(0,),
                   priority=priority)


def stub_sample(output: SchedulerOutput) -> dict[str, list[int]]:
    """The token a model would sample: 7, for every request that reached its last token."""
    return {s.request.request_id: [7] for s in output.scheduled if s.samples}


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return outputs
        output = scheduler.schedule()
        scheduler.update_from_output(output, stub_sample(output))
        outputs.append(output)
    raise AssertionError("the scheduler did not finish its requests")


def assert_pool_consistent(scheduler: Scheduler) -> None:
    kv_cache = scheduler.kv_cache
    pool = kv_cache.pool
    owners: dict[int, int] = {}
    for request_id, blocks in kv_cache.blocks_of.items():
        ids = [block.block_id for block in blocks]
        assert len(ids) == len(set(ids)), f"{request_id} owns a block twice"
        assert kv_cache.block_ids(request_id) == ids
        for block_id in ids:
            owners[block_id] = owners.get(block_id, 0) + 1
    for block in pool.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == owners.get(block.block_id, 0)
        assert (block.block_id in pool.free_queue) == (block.ref_count == 0)
    for request in scheduler.running:
        assert len(kv_cache.blocks_of[request.request_id]) * BLOCK_SIZE >= request.num_computed_tokens
        if scheduler.config.batching == "continuous":  # exactly the blocks its computed tokens fill
            assert len(kv_cache.blocks_of[request.request_id]) == -(-request.num_computed_tokens // BLOCK_SIZE)
    waiting = {request.request_id for _, _, request in scheduler.waiting}
    assert not waiting & kv_cache.blocks_of.keys(), "a waiting request holds blocks"
    # Swap space: the count is the sum of what swapped-out (waiting) requests hold in host memory.
    assert scheduler.num_swapped_blocks == sum(scheduler.swapped.values()) <= scheduler.num_swap_blocks
    assert scheduler.swapped.keys() <= waiting
    # Per-request maps hold only requests still in the engine.
    assert kv_cache.hashes_of.keys() <= scheduler.requests.keys() | scheduler.held.keys()
    assert kv_cache.num_cached_of.keys() <= kv_cache.blocks_of.keys()
    assert scheduler.order.keys() == scheduler.requests.keys()
    if not scheduler.num_unfinished:
        assert not kv_cache.blocks_of and not kv_cache.hashes_of and not kv_cache.num_cached_of
        assert not scheduler.swapped and scheduler.num_swapped_blocks == 0



def step_preempting(scheduler: Scheduler) -> list[str]:
    """One step with stub samples; the ids it preempted, none of which it also scheduled."""
    output = scheduler.schedule()
    scheduled = {s.request.request_id for s in output.scheduled}
    preempted = [request.request_id for request in output.preempted]
    assert not scheduled & set(preempted), "a request both scheduled and preempted in one step"
    scheduler.update_from_output(output, stub_sample(output))
    return preempted

def test_decodes_first_then_chunked_prefill_fills_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", 6, max_tokens=5))
    first = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("a", 6)]
    assert first.num_batched_tokens == 6  # the budget is not all used
    scheduler.update_from_output(first, stub_sample(first))
    scheduler.add_request(make_request("b", 20, first_token=100))
    second = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in second.scheduled] == [("a", 1), ("b", 9)]
    assert second.num_batched_tokens == 10
    scheduler.update_from_output(second, stub_sample(second))
    b = scheduler.requests["b"]
    assert b.num_computed_tokens == 9 and b.num_output_tokens == 0  # a chunk: nothing sampled


def test_max_num_seqs_caps_the_running_batch() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", 4, first_token=10 * index + 1))
    output = scheduler.schedule()
    assert len(output.scheduled) == 2 and len(scheduler.waiting) == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 6))
    scheduler.add_request(make_request("b", 6, first_token=50))
    output = scheduler.schedule()
    assert [s.request.request_id for s in output.scheduled] == ["a"]


def test_priority_policy_admits_lower_values_first() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    scheduler.add_request(make_request("late", 4, priority=5))
    scheduler.add_request(make_request("urgent", 4, priority=-1, first_token=40))
    output = scheduler.schedule()
    assert [s.request.request_id for s in output.scheduled] == ["urgent"]


def test_waiting_queue_bound_rejects_with_a_clear_error() -> None:
    scheduler = make_scheduler(max_waiting_requests=1)
    scheduler.add_request(make_request("a", 4))
    with pytest.raises(QueueFullError, match="full"):
        scheduler.add_request(make_request("b", 4))


def test_preempted_requests_do_not_fill_the_waiting_queue() -> None:
    """The bound is on requests not yet admitted: a preempted one waits too, but was let in."""
    scheduler = make_scheduler(num_blocks=8, max_waiting_requests=1)
    for index in range(4):
        scheduler.add_request(make_request(f"r{index}", 5, max_tokens=10, first_token=20 * index + 1))
        scheduler.update_from_output(output := scheduler.schedule(), stub_sample(output))
    while not any(request.status == RequestStatus.PREEMPTED for _, _, request in scheduler.waiting):
        scheduler.update_from_output(output := scheduler.schedule(), stub_sample(output))
    assert scheduler.num_queued == 0
    scheduler.add_request(make_request("new", 4, first_token=200))
    with pytest.raises(QueueFullError, match="full"):
        scheduler.add_request(make_request("newer", 4, first_token=220))
    run_to_completion(scheduler)
    assert scheduler.kv_cache.pool.num_free_blocks == 8


def test_prompt_longer_than_context_is_refused() -> None:
    scheduler = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="context"):
        scheduler.check_request_fits(make_request("a", 16))


def test_prefix_cache_hits_reuse_blocks_and_are_counted() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 13, max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("b", 13, max_tokens=1))
    output = scheduler.schedule()
    # 3 full blocks of the 13-token prompt are cached; the last token is always recomputed.
    assert output.scheduled[0].num_new_tokens == 1
    assert scheduler.requests["b"].num_cached_tokens == 12
    assert scheduler.kv_cache.prefix_hits == 12


def test_requests_of_two_cache_domains_never_share_prefix_blocks() -> None:
    """A tenant (or a cache_salt) is a domain of its own: another's identical prompt finds nothing
    cached, while a second request of the same domain finds its blocks."""
    scheduler = make_scheduler()

    def cached_tokens(request_id: str, domain: str) -> int:
        request = make_request(request_id, 13, max_tokens=1)
        request.sampling_params = SamplingParams(max_tokens=1, temperature=0, cache_domain=domain)
        scheduler.add_request(request)
        run_to_completion(scheduler)
        return request.num_cached_tokens

    assert cached_tokens("a1", "tenant-a") == 0
    assert cached_tokens("b1", "tenant-b") == 0  # the same prompt in another domain: a miss
    assert cached_tokens("shared", "") == 0
    assert cached_tokens("a2", "tenant-a") == 12
    assert cached_tokens("b2", "tenant-b") == 12
    assert_pool_consistent(scheduler)


def test_whole_prompt_cached_still_computes_its_last_token() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 12, max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("b", 12, max_tokens=1))
    output = scheduler.schedule()
    assert output.scheduled[0].num_new_tokens == 4  # 2 blocks hit, the third holds the last token


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_undersized_pool_preempts_last_admitted_and_everyone_finishes(mode: str) -> None:
    scheduler = make_scheduler(num_blocks=8, preemption_mode=mode)
    for index in range(4):
        scheduler.add_request(make_request(f"r{index}", 5, max_tokens=10, first_token=20 * index + 1))
    outputs = run_to_completion(scheduler)
    preempted = [r.request_id for o in outputs for r in o.preempted]
    assert preempted and preempted[0] == "r3"
    if mode == "swap":
        assert any(o.swap_out for o in outputs) and any(o.swap_in for o in outputs)
    assert scheduler.kv_cache.pool.num_free_blocks == 8


def test_static_batching_admits_only_when_the_batch_is_done() -> None:
    scheduler = make_scheduler(batching="static", max_num_seqs=2)
    scheduler.add_request(make_request("a", 4, max_tokens=1))
    scheduler.add_request(make_request("b", 4, max_tokens=5, first_token=30))
    scheduler.add_request(make_request("c", 4, max_tokens=1, first_token=60))
    first = scheduler.schedule()
    scheduler.update_from_output(first, stub_sample(first))  # a finishes here
    second = scheduler.schedule()
    assert [s.request.request_id for s in second.scheduled] == ["b"]  # c may not join b's batch
    run_to_completion(scheduler)


def test_abort_anywhere_frees_blocks() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 9))
    scheduler.add_request(make_request("b", 9, first_token=70))
    scheduler.schedule()
    scheduler.add_request(make_request("c", 9, first_token=140))
    for request_id in ("a", "c", "b"):
        request = scheduler.abort(request_id)
        assert request is not None and request.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.pool.num_free_blocks == 64 and not scheduler.waiting and not scheduler.running


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(0, 0), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.integers(0, 0), st.integers(0, 0)),
    ),
    min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(operations, st.sampled_from(["recompute", "swap"]), st.integers(6, 40), st.integers(4, 64), st.booleans())
def test_block_invariants_hold_under_random_traffic(ops: list[tuple[str, int, int, int]], mode: str,
                                                   num_blocks: int, budget: int, chunked: bool) -> None:
    max_model_len = num_blocks * BLOCK_SIZE
    scheduler = make_scheduler(num_blocks=num_blocks, max_model_len=max_model_len, preemption_mode=mode,
                               max_num_batched_tokens=max(budget, max_model_len if not chunked else 1),
                               enable_chunked_prefill=chunked)
    rng = random.Random(0)
    ids: list[str] = []
    for op, a, b, c in ops:
        if op == "add" and a + 1 < max_model_len:
            request_id = f"r{len(ids)}"
            # Few distinct starts, so prompts share prefixes and hit the cache.
            scheduler.add_request(make_request(request_id, a, max_tokens=b, first_token=1 + c))
            ids.append(request_id)
        elif op == "abort" and ids:
            scheduler.abort(ids[a % len(ids)])
        elif op == "step":
            output = scheduler.schedule()
            scheduler.update_from_output(output, {k: [rng.randrange(1, 50)] for k in stub_sample(output)})
        assert_pool_consistent(scheduler)
    run_to_completion(scheduler)
    assert_pool_consistent(scheduler)
    assert scheduler.kv_cache.pool.num_free_blocks == num_blocks
    assert not scheduler.kv_cache.blocks_of and not scheduler.kv_cache.block_ids_of


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_step_that_preempts_admits_no_one_and_everyone_finishes(mode: str) -> None:
    """Preempting to make room and admitting a newcomer in the same step would hand the newcomer the
    blocks just freed and preempt again next step (thrash): a preempting step admits nobody."""
    scheduler = make_scheduler(num_blocks=8, preemption_mode=mode)
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", 6, max_tokens=12, first_token=20 * index + 1))
    preempting_steps = 0
    for _ in range(500):
        if not scheduler.num_unfinished:
            break
        running_before = {request.request_id for request in scheduler.running}
        output = scheduler.schedule()
        if output.preempted:
            preempting_steps += 1
            assert {s.request.request_id for s in output.scheduled} <= running_before
        scheduler.update_from_output(output, stub_sample(output))
        assert_pool_consistent(scheduler)
    assert preempting_steps > 0 and not scheduler.num_unfinished
    assert scheduler.kv_cache.pool.num_free_blocks == 8


# ---- disaggregation on the decode side: reservations, their leases, admission --------------------


def test_a_reservation_whose_lease_ends_waits_without_blocks_for_its_router_to_say_the_first_token() -> None:
    """A prefill may have streamed a first token the decode worker does not know: it never samples
    one of its own when the lease ends, it parks the request (blocks freed) until the router says."""
    scheduler = make_scheduler(num_blocks=16)
    request = make_request("remote", 9, max_tokens=3)
    assert scheduler.reserve_remote(request, lease_s=30.0) == scheduler.kv_cache.block_ids("remote")
    assert len(scheduler.kv_cache.block_ids("remote")) == 3  # the whole prompt's blocks, reserved
    with pytest.raises(ValueError, match="^request id 'remote' is already in the engine$"):
        scheduler.reserve_remote(make_request("remote", 4), lease_s=30.0)
    assert scheduler.expire_reservations(time.monotonic() + 29) == []  # the lease still holds
    assert scheduler.expire_reservations(time.monotonic() + 31) == []  # nothing to tell its stream yet
    assert set(scheduler.parked) == {"remote"} and request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert not scheduler.kv_cache.block_ids("remote") and scheduler.schedule().empty  # parked, not run
    assert scheduler.settle("remote", None) is request and request.status == RequestStatus.WAITING
    assert scheduler.num_recomputes == 1 and not scheduler.parked
    assert scheduler.fail_remote("remote") is None and scheduler.num_recomputes == 1  # counted once
    run_to_completion(scheduler)
    assert request.num_output_tokens == 3
    assert_pool_consistent(scheduler)


def test_a_lost_kv_is_recomputed_after_the_first_token_the_router_said() -> None:
    scheduler = make_scheduler(num_blocks=16)
    request = make_request("said", 9, max_tokens=3)
    scheduler.reserve_remote(request, lease_s=30.0)
    assert scheduler.settle("said", 42) is None and scheduler.settled == {"said": 42}  # the KV may still land
    (news,) = scheduler.expire_reservations(time.monotonic() + 31)
    assert news is request and request.output_token_ids == [42] and request.status == RequestStatus.WAITING
    assert not scheduler.settled and not scheduler.parked and not scheduler.reserved
    run_to_completion(scheduler)
    assert request.output_token_ids[0] == 42 and request.num_output_tokens == 3
    assert_pool_consistent(scheduler)


def test_a_parked_request_nobody_claims_is_aborted_and_a_settled_one_admitted_leaves_no_entry() -> None:
    scheduler = make_scheduler(num_blocks=16)
    request = make_request("orphan", 9)
    scheduler.reserve_remote(request, lease_s=1.0)
    now = time.monotonic()
    assert scheduler.expire_reservations(now + 2) == []
    assert scheduler.expire_reservations(now + 1 + PARKED_S) == []  # not yet: parked at now + 2
    assert scheduler.expire_reservations(now + 2 + PARKED_S) == [request]  # its router is gone
    assert request.status == RequestStatus.FINISHED_ABORTED and not scheduler.parked and not scheduler.num_unfinished
    landed = make_request("landed", 9, first_token=7)
    scheduler.reserve_remote(landed, lease_s=30.0)
    scheduler.settle("landed", 7)
    scheduler.admit_remote("landed", 7)
    assert not scheduler.settled and not scheduler.reserved
    aborted = make_request("aborted", 9)
    scheduler.reserve_remote(aborted, lease_s=1.0)
    scheduler.expire_reservations(time.monotonic() + 2)
    assert scheduler.abort("aborted") is aborted and not scheduler.parked
    scheduler.abort("landed")
    assert_pool_consistent(scheduler)
    assert scheduler.kv_cache.pool.num_free_blocks == 16


def test_every_failed_reservation_is_counted_once() -> None:
    scheduler = make_scheduler(num_blocks=32)
    for index in range(3):
        scheduler.reserve_remote(make_request(f"f{index}", 5, first_token=10 * index + 1), lease_s=30.0)
    assert scheduler.fail_remote("f0") is not None and scheduler.fail_remote("f1") is not None
    assert scheduler.fail_remote("unknown") is None
    assert scheduler.num_recomputes == 2


def test_admitted_kv_counts_as_computed_not_cached_and_a_first_token_can_end_the_request() -> None:
    scheduler = make_scheduler(num_blocks=16)
    going_on, ending = make_request("on", 6, max_tokens=3), make_request("end", 6, max_tokens=1, first_token=50)
    for request in (going_on, ending):
        scheduler.reserve_remote(request, lease_s=30.0)
    scheduler.admit_remote("on", first_token_id=7)
    assert going_on.num_computed_tokens == 6 and going_on.num_cached_tokens == 0
    assert going_on.status == RequestStatus.WAITING_FOR_REMOTE_KV and list(scheduler.remote_ready) == [going_on]
    scheduler.admit_remote("end", first_token_id=7)  # max_tokens 1: the prefill's token was the last
    assert ending.status == RequestStatus.FINISHED_LENGTH
    assert "end" not in scheduler.requests and not scheduler.kv_cache.block_ids("end")
    run_to_completion(scheduler)
    assert going_on.num_output_tokens == 3
    assert_pool_consistent(scheduler)


def test_releasing_an_unknown_held_prefill_is_harmless() -> None:
    assert make_scheduler().release_held("never-held") is None


def test_priority_preemption_takes_the_worst_priority_not_yet_scheduled() -> None:
    """Under the priority policy the victim is the worst-priority request not yet scheduled this step,
    not the last admitted (FCFS), and never one already scheduled in the same step."""
    scheduler = make_scheduler(num_blocks=9, policy="priority")
    scheduler.add_request(make_request("first", 4, max_tokens=30, priority=1, first_token=1))
    scheduler.add_request(make_request("low", 4, max_tokens=30, priority=9, first_token=40))
    scheduler.update_from_output(output := scheduler.schedule(), stub_sample(output))
    scheduler.add_request(make_request("mid", 4, max_tokens=30, priority=5, first_token=80))
    victims: list[str] = []
    for _ in range(80):
        victims += step_preempting(scheduler)
        if victims:
            break
    assert victims[0] == "low"  # FCFS would take "mid", admitted last


def test_preemptions_are_counted_exactly() -> None:
    scheduler = make_scheduler(num_blocks=6)
    requests = [make_request(f"p{index}", 4, max_tokens=14, first_token=30 * index + 1) for index in range(3)]
    for request in requests:
        scheduler.add_request(request)
    events = 0
    per_request = {request.request_id: 0 for request in requests}
    for _ in range(300):
        if not scheduler.num_unfinished:
            break
        output = scheduler.schedule()
        events += len(output.preempted)
        for request in output.preempted:
            per_request[request.request_id] += 1
        scheduler.update_from_output(output, stub_sample(output))
    assert events >= 2 and {r.request_id: r.num_preemptions for r in requests} == per_request
    assert events > 0 and scheduler.num_preemptions == events


@pytest.mark.parametrize("swap_blocks", [0, 1])
def test_swap_space_is_used_only_in_swap_mode_and_never_beyond_its_size(swap_blocks: int) -> None:
    for mode in ("recompute", "swap"):
        kv_cache = KVCacheManager(BlockPool(6), BLOCK_SIZE)
        scheduler = Scheduler(SchedulerConfig(preemption_mode=mode), kv_cache, 64, num_swap_blocks=swap_blocks + 8)
        if mode == "swap":
            scheduler.num_swap_blocks = swap_blocks
        for index in range(3):
            scheduler.add_request(make_request(f"s{index}", 4, max_tokens=10, first_token=30 * index + 1))
        for _ in range(300):
            if not scheduler.num_unfinished:
                break
            output = scheduler.schedule()
            if mode == "recompute":
                assert not output.swap_out
            assert scheduler.num_swapped_blocks <= scheduler.num_swap_blocks
            scheduler.update_from_output(output, stub_sample(output))
            assert_pool_consistent(scheduler)
        assert not scheduler.num_unfinished and scheduler.num_swapped_blocks == 0


def test_a_swap_that_exactly_fills_the_swap_space_is_taken() -> None:
    kv_cache = KVCacheManager(BlockPool(6), BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(preemption_mode="swap"), kv_cache, 64, num_swap_blocks=3)
    for index in range(2):
        scheduler.add_request(make_request(f"s{index}", 8, max_tokens=8, first_token=30 * index + 1))
    for _ in range(100):
        output = scheduler.schedule()
        if output.preempted:
            break
        scheduler.update_from_output(output, stub_sample(output))
    (victim,) = output.preempted
    assert [order.request_id for order in output.swap_out] == [victim.request_id]
    assert scheduler.num_swapped_blocks == 3 == scheduler.num_swap_blocks  # exactly full, not refused


def test_a_prompt_that_leaves_no_room_for_a_token_is_refused() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=1024)
    scheduler.check_request_fits(make_request("fits", 4 * BLOCK_SIZE - 1))
    with pytest.raises(ValueError, match=r"^the prompt needs 5 KV blocks but the pool has only 4; raise num_blocks"):
        scheduler.check_request_fits(make_request("full", 4 * BLOCK_SIZE))


def test_a_reservation_expires_at_its_deadline() -> None:
    scheduler = make_scheduler(num_blocks=16)
    scheduler.reserve_remote(make_request("r", 5), lease_s=10.0)
    deadline = scheduler.reserved["r"][1]
    assert scheduler.expire_reservations(deadline - 1e-3) == [] and set(scheduler.reserved) == {"r"}
    assert scheduler.expire_reservations(deadline) == [] and set(scheduler.parked) == {"r"}


def test_without_chunked_prefill_a_prompt_of_exactly_the_budget_runs_at_once() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 8))
    output = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 8)]


def test_a_duplicate_request_id_is_refused_and_the_first_request_goes_on() -> None:
    scheduler = make_scheduler()
    first = make_request("a", 4)
    scheduler.add_request(first)
    with pytest.raises(ValueError, match="^request id 'a' is already in the engine$"):
        scheduler.add_request(make_request("a", 6, first_token=50))
    run_to_completion(scheduler)
    assert first.num_output_tokens == 4


def test_eos_ends_a_request_once_min_tokens_are_out_unless_it_is_ignored() -> None:
    scheduler = make_scheduler()
    prompt = [5, 6, 7]
    requests = {
        "plain": Request("plain", prompt, SamplingParams(max_tokens=6, temperature=0), eos_token_ids=(0,)),
        "min": Request("min", prompt, SamplingParams(max_tokens=6, min_tokens=3, temperature=0), eos_token_ids=(0,)),
        "ignored": Request("ignored", prompt, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0),
                           eos_token_ids=(0,)),
    }
    for request in requests.values():
        scheduler.add_request(request)
    while scheduler.num_unfinished:  # the model samples EOS every time
        output = scheduler.schedule()
        scheduler.update_from_output(output, {s.request.request_id: [0] for s in output.scheduled if s.samples})
    assert {request_id: (request.num_output_tokens, request.status) for request_id, request in requests.items()} == {
        "plain": (1, RequestStatus.FINISHED_STOPPED), "min": (3, RequestStatus.FINISHED_STOPPED),
        "ignored": (6, RequestStatus.FINISHED_LENGTH)}


def test_a_request_ended_between_schedule_and_update_takes_no_token_and_the_rest_do() -> None:
    """Between a step's schedule and its update a request may end (aborted, or stopped by a stop
    string its caller found): it takes no token, and the requests scheduled after it take theirs."""
    scheduler = make_scheduler()
    requests = {request_id: make_request(request_id, 4, max_tokens=1 if request_id == "last" else 5,
                                         first_token=20 * index + 1)
                for index, request_id in enumerate(("aborted", "stopped", "going", "last"))}
    for request in requests.values():
        scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.abort("aborted")
    scheduler.finish(requests["stopped"], RequestStatus.FINISHED_STOPPED)
    finished = scheduler.update_from_output(output, stub_sample(output))
    assert finished == [requests["last"]]  # the requests this update finished
    assert {request_id: request.output_token_ids for request_id, request in requests.items()} == {
        "aborted": [], "stopped": [], "going": [7], "last": [7]}
    assert requests["going"].num_computed_tokens == 4
    run_to_completion(scheduler)
    assert requests["going"].num_output_tokens == 5 and requests["stopped"].num_output_tokens == 0
    assert_pool_consistent(scheduler)


def test_without_swap_space_swap_mode_recomputes() -> None:
    scheduler = Scheduler(SchedulerConfig(preemption_mode="swap"), KVCacheManager(BlockPool(2), BLOCK_SIZE), 64)
    for index in range(2):  # one block each, until both need a second one
        scheduler.add_request(make_request(f"s{index}", 3, max_tokens=6, first_token=30 * index + 1))
    outputs = run_to_completion(scheduler)
    assert any(output.preempted for output in outputs)
    assert not any(output.swap_out for output in outputs)


def test_priority_preemption_never_takes_a_request_already_scheduled_in_the_step() -> None:
    """The worst-priority request ("low") was admitted first, so it is scheduled before "high" each
    step: when "high" needs a block it preempts itself, not "low", whose step is already planned."""
    scheduler = make_scheduler(num_blocks=3, policy="priority")
    low = make_request("low", 3, max_tokens=6, priority=9)
    scheduler.add_request(low)
    scheduler.update_from_output(output := scheduler.schedule(), stub_sample(output))
    high = make_request("high", 3, max_tokens=6, priority=1, first_token=40)
    scheduler.add_request(high)
    victims: list[str] = []
    for _ in range(200):
        if not scheduler.num_unfinished:
            break
        victims += step_preempting(scheduler)
        assert_pool_consistent(scheduler)
    assert victims and not scheduler.num_unfinished
    assert low.num_output_tokens == high.num_output_tokens == 6


def test_a_request_preempted_twice_counts_twice_and_reports_the_cache_of_its_first_admission() -> None:
    """Recomputed after a preemption, a request finds its own blocks in the prefix cache: that is not
    a cache hit of its prompt, which had none (the prompts share nothing)."""
    scheduler = make_scheduler(num_blocks=5)
    requests = [make_request(f"p{index}", 4, max_tokens=10, first_token=30 * index + 1) for index in range(3)]
    for request in requests:
        scheduler.add_request(request)
    per_request = {request.request_id: 0 for request in requests}
    for output in run_to_completion(scheduler):
        for request in output.preempted:
            per_request[request.request_id] += 1
    assert max(per_request.values()) >= 2
    assert {request.request_id: request.num_preemptions for request in requests} == per_request
    assert scheduler.kv_cache.prefix_hits > 0  # readmissions did hit their own blocks
    assert [request.num_cached_tokens for request in requests] == [0, 0, 0]


def test_static_batching_admits_a_request_only_when_its_whole_prompt_fits() -> None:
    """A static batch runs to its end: its prompts' blocks are reserved at admission, so a prompt that
    does not fit whole waits for the next batch rather than preempting later."""
    scheduler = make_scheduler(num_blocks=3, batching="static", max_num_batched_tokens=4, max_num_seqs=2)
    first, second = make_request("first", 8, max_tokens=4), make_request("second", 8, max_tokens=4, first_token=50)
    scheduler.add_request(first)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert [request.request_id for request in scheduler.running] == ["first"]
    assert len(scheduler.kv_cache.block_ids("first")) == 2  # its whole prompt, though 4 tokens run
    scheduler.update_from_output(output, stub_sample(output))
    outputs = run_to_completion(scheduler)
    assert not any(output.preempted for output in outputs)
    assert first.num_output_tokens == second.num_output_tokens == 4


def test_prefix_cache_lookups_and_hits_add_up_over_requests() -> None:
    scheduler = make_scheduler()
    for request_id, prompt_len in (("a", 13), ("b", 13), ("c", 9)):  # the same first tokens
        scheduler.add_request(make_request(request_id, prompt_len, max_tokens=1))
        run_to_completion(scheduler)
    kv_cache = scheduler.kv_cache
    assert (kv_cache.prefix_queries, kv_cache.prefix_hits) == (13 + 13 + 9, 12 + 8)


def test_a_follow_up_prompt_hits_the_blocks_the_answer_filled() -> None:
    """A chat's next turn repeats the last prompt and its answer: the blocks the answer's tokens
    filled are cached too, chained to the prompt's."""
    scheduler = make_scheduler()
    first = make_request("first", 6, max_tokens=8)  # 13 tokens computed: 3 full blocks
    scheduler.add_request(first)
    run_to_completion(scheduler)
    follow_up = Request("next", first.all_token_ids + [90, 91], SamplingParams(max_tokens=1, temperature=0))
    scheduler.add_request(follow_up)
    scheduler.schedule()
    assert follow_up.num_cached_tokens == 12


def test_fcfs_policy_ignores_priorities() -> None:
    """Priorities order the queue only under the priority policy; FCFS serves in arrival order."""
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("early", 4, priority=5))
    scheduler.add_request(make_request("urgent", 4, priority=-1, first_token=40))
    output = scheduler.schedule()
    assert [s.request.request_id for s in output.scheduled] == ["early"]


def test_the_first_token_time_is_stamped_when_it_is_sampled_and_kept() -> None:
    """It is the request's time to first token: set by the first sample, untouched by later ones."""
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", 6, max_tokens=3)
    scheduler.add_request(request)
    scheduler.update_from_output(output := scheduler.schedule(), stub_sample(output))  # a chunk: no token
    assert request.first_token_time is None
    before = time.monotonic()
    scheduler.update_from_output(output := scheduler.schedule(), stub_sample(output))
    stamped = request.first_token_time
    assert stamped is not None and before <= stamped <= time.monotonic()
    run_to_completion(scheduler)
    assert request.num_output_tokens == 3 and request.first_token_time == stamped


def test_a_block_filled_by_the_last_token_a_request_computes_is_cached() -> None:
    """Prompt 6 + 3 answers: the last step computes token 8, filling the second block as the request
    ends; a follow-up that repeats the exchange hits both blocks, not just the first."""
    scheduler = make_scheduler()
    first = make_request("first", 6, max_tokens=3)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    follow_up = Request("next", first.all_token_ids + [90], SamplingParams(max_tokens=1, temperature=0))
    scheduler.add_request(follow_up)
    scheduler.schedule()
    assert follow_up.num_cached_tokens == 2 * BLOCK_SIZE


# ---- decode side: requests whose KV arrived join the batch ---------------------------------------


def arrived(scheduler: Scheduler, request_id: str, prompt_len: int, max_tokens: int = 4,
            first_token: int = 1) -> Request:
    """A request whose prompt KV a prefill worker sent: reserved, then admitted with its first token."""
    request = make_request(request_id, prompt_len, max_tokens=max_tokens, first_token=first_token)
    assert scheduler.reserve_remote(request, lease_s=30.0) is not None
    scheduler.admit_remote(request_id, first_token_id=7)
    return request


def test_requests_whose_kv_arrived_take_one_token_each_and_prompts_get_the_rest() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    arrived(scheduler, "r0", 5)
    arrived(scheduler, "r1", 5, first_token=50)
    scheduler.add_request(make_request("local", 20, first_token=100))
    output = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [
        ("r0", 1), ("r1", 1), ("local", 8)]
    assert output.num_batched_tokens == 10


@pytest.mark.parametrize("limit", [{"max_num_batched_tokens": 2}, {"max_num_seqs": 2}])
def test_a_request_whose_kv_arrived_joins_only_within_the_steps_budget_and_batch_size(
        limit: dict[str, int]) -> None:
    """A decode running already leaves room for exactly one more: the first arrival joins, the
    second waits for the next step."""
    scheduler = make_scheduler(**limit)
    scheduler.add_request(make_request("decode", 2, max_tokens=10, first_token=100))
    scheduler.update_from_output(output := scheduler.schedule(), stub_sample(output))
    arrived(scheduler, "r0", 5)
    second = arrived(scheduler, "r1", 5, first_token=50)
    output = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("decode", 1), ("r0", 1)]
    assert list(scheduler.remote_ready) == [second]


def test_a_request_whose_kv_arrived_needs_only_the_slot_of_its_next_token() -> None:
    """Its 7-token prompt and the token after it fill the 2-block pool exactly: it runs at once."""
    scheduler = make_scheduler(num_blocks=2)
    request = arrived(scheduler, "r", 7, max_tokens=2)
    output = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("r", 1)]
    assert len(scheduler.kv_cache.block_ids("r")) == 2
    scheduler.update_from_output(output, stub_sample(output))
    assert request.status == RequestStatus.FINISHED_LENGTH and scheduler.kv_cache.pool.num_free_blocks == 2


def test_a_request_whose_kv_arrived_waits_for_a_free_block_and_the_step_goes_on() -> None:
    scheduler = make_scheduler(num_blocks=3)
    decode = make_request("decode", 3, max_tokens=3, first_token=100)
    scheduler.add_request(decode)
    scheduler.update_from_output(output := scheduler.schedule(), stub_sample(output))
    request = arrived(scheduler, "r", 8, max_tokens=2)  # its 2 blocks fill the pool; its next token needs a 3rd
    output = scheduler.schedule()
    assert [s.request.request_id for s in output.scheduled] == ["decode"] and output.num_batched_tokens == 1
    assert list(scheduler.remote_ready) == [request]
    run_to_completion(scheduler)
    assert decode.num_output_tokens == 3 and request.num_output_tokens == 2
    assert_pool_consistent(scheduler)


def test_a_request_admitted_to_a_static_batch_with_no_budget_left_runs_nothing_this_step() -> None:
    """Static batching admits the whole batch at once; a member the step's budget cannot reach yet
    holds its blocks but is not handed to the model with zero tokens."""
    scheduler = make_scheduler(batching="static", max_num_batched_tokens=4, max_num_seqs=2)
    first, second = make_request("first", 4), make_request("second", 4, first_token=50)
    scheduler.add_request(first)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert scheduler.running == [first, second]
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("first", 4)]
    run_to_completion(scheduler)
    assert first.num_output_tokens == second.num_output_tokens == 4
