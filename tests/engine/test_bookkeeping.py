"""What a user would notice if the engine's bookkeeping slipped: a prefix hit on a block that differs
only at its end changes the answer, exact block counts, memory that grows with requests served,
swap space that is never given back, a prompt that fills the pool exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from tests.engine.test_engine_outputs import checkpoint, make_engine  # noqa: F401  (the module fixture)

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
BLOCK = 4


def steps(engine: LLMEngine, limit: int = 2_000) -> dict[str, list[int]]:
    """Run the engine until idle (at most `limit` steps: a hang is a failure, not a timeout)."""
    finished: dict[str, list[int]] = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.token_ids)
    raise AssertionError(f"the engine did not finish in {limit} steps")


def alone(checkpoint: Path, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:  # noqa: F811
    engine = make_engine(checkpoint, block_size=BLOCK)
    engine.add_request(prompt, params, request_id="alone")
    return steps(engine)["alone"]


def assert_nothing_left(engine: LLMEngine) -> None:
    """Idle engine: every per-request map empty, every block free, no swap space held."""
    scheduler, kv_cache = engine.scheduler, engine.kv_cache
    assert not engine.has_unfinished_requests()
    assert not scheduler.requests and not scheduler.order and not scheduler.running and not scheduler.waiting
    assert not scheduler.swapped and scheduler.num_swapped_blocks == 0
    assert not scheduler.held and not scheduler.reserved and not scheduler.remote_ready
    assert not kv_cache.blocks_of and not kv_cache.block_ids_of and not kv_cache.hashes_of
    assert not kv_cache.num_cached_of
    assert not engine.detokenizers and not engine.runner.swap_store
    assert kv_cache.pool.num_free_blocks == kv_cache.pool.num_blocks


@pytest.mark.parametrize("position", [0, BLOCK - 1])  # the first or the last token of the second block
def test_prompts_that_differ_inside_a_block_never_share_it(checkpoint: Path, position: int) -> None:  # noqa: F811
    first = list(range(10, 10 + 3 * BLOCK + 1))  # 3 full blocks, then one token
    second = list(first)
    second[BLOCK + position] = 299
    engine = make_engine(checkpoint, block_size=BLOCK)
    engine.add_request(first, GREEDY, request_id="first")
    steps(engine)
    engine.add_request(second, GREEDY, request_id="second")
    outputs: dict[str, list[int]] = {}
    cached = -1
    for _ in range(100):
        for output in engine.step():
            cached = output.num_cached_tokens if cached < 0 else cached
            if output.finished:
                outputs[output.request_id] = list(output.token_ids)
        if not engine.has_unfinished_requests():
            break
    assert cached == BLOCK  # only the first block is the same
    assert outputs["second"] == alone(checkpoint, second)


def test_a_request_holds_exactly_the_blocks_its_tokens_fill(checkpoint: Path) -> None:  # noqa: F811
    engine = make_engine(checkpoint, block_size=BLOCK, num_blocks=64)
    for length in (1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK):
        request_id = f"len-{length}"
        engine.add_request(list(range(20, 20 + length)), SamplingParams(max_tokens=3, temperature=0,
                                                                         ignore_eos=True), request_id=request_id)
        engine.step()  # the prompt computed, its first token sampled
        computed = engine.scheduler.requests[request_id].num_computed_tokens
        assert computed == length
        assert len(engine.kv_cache.block_ids(request_id)) == -(-length // BLOCK), length
        engine.abort(request_id)
    assert_nothing_left(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_serving_many_requests_leaves_nothing_behind(checkpoint: Path, mode: str) -> None:  # noqa: F811
    """Finished, aborted and preempted (recomputed or swapped) requests all leave the engine as it was."""
    engine = make_engine(checkpoint, block_size=BLOCK, num_blocks=14, mode=mode)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for round_ in range(3):
        for index in range(4):
            engine.add_request([30 + index + round_] * (BLOCK * 2 + index), params, request_id=f"r{round_}-{index}")
        for _ in range(5):
            engine.step()
        engine.abort(f"r{round_}-1")
        steps(engine)
        assert_nothing_left(engine)
    assert engine.scheduler.num_preemptions > 0  # the pool was too small: preemption really happened


def test_swapped_out_requests_give_their_swap_space_back_when_they_end(checkpoint: Path) -> None:  # noqa: F811
    engine = make_engine(checkpoint, block_size=BLOCK, num_blocks=10, mode="swap")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for index in range(3):
        engine.add_request([40 + index] * (2 * BLOCK), params, request_id=f"s{index}")
    for _ in range(200):
        engine.step()
        if engine.scheduler.swapped:
            break
    (victim,) = engine.scheduler.swapped
    assert engine.scheduler.num_swapped_blocks == engine.scheduler.swapped[victim] > 0
    engine.abort(victim)  # ends while swapped out
    assert engine.scheduler.num_swapped_blocks == 0 and victim not in engine.runner.swap_store
    steps(engine)
    assert_nothing_left(engine)


def test_a_prompt_that_fills_the_pool_exactly_finishes(checkpoint: Path) -> None:  # noqa: F811
    num_blocks = 6
    engine = make_engine(checkpoint, block_size=BLOCK, num_blocks=num_blocks)
    prompt = list(range(50, 50 + num_blocks * BLOCK - 1))  # its last output token fills the last slot
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), request_id="full")
    assert steps(engine)["full"] == alone(checkpoint, prompt, SamplingParams(max_tokens=1, temperature=0,
                                                                             ignore_eos=True))
    assert_nothing_left(engine)


def test_a_prompt_one_block_larger_than_the_pool_is_refused_up_front(checkpoint: Path) -> None:  # noqa: F811
    num_blocks = 6
    engine = make_engine(checkpoint, block_size=BLOCK, num_blocks=num_blocks)
    with pytest.raises(ValueError):
        engine.add_request(list(range(50, 50 + num_blocks * BLOCK + 1)), GREEDY)
    assert_nothing_left(engine)
