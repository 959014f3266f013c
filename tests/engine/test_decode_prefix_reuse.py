"""A decode engine that holds a conversation's earlier turns takes their KV from its own prefix cache:
only the blocks after them come from the prefill engine, and a short enough rest is computed on the
decode engine itself. Tokens equal the engine alone's; every block comes back."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_disaggregation import drain, make_engine, run_prefill
from tests.engine.test_engine_outputs import GREEDY, assert_pool_whole

FIRST_TURN = list(range(200, 241))  # 41 tokens: ten full blocks of 4 and one token
ANSWER_TOKENS = GREEDY.max_tokens  # 24: the decode engine computes the KV of all but the last


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def disaggregated_turn(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], request_id: str) -> tuple[
        list[int], int]:
    """One turn through a prefill and a decode engine, reusing the decode engine's cache: its tokens
    and the blocks the prefill engine sent."""
    reservation = decode.reserve_prompt(prompt, GREEDY, request_id=request_id)
    assert reservation is not None and not reservation.local
    first = run_prefill(prefill, prompt, request_id)
    export = prefill.export_kv(request_id, reservation.num_reused_blocks)
    prefill.release_held(request_id)
    decode.import_kv(request_id, export.data.clone())
    decode.admit_remote(request_id, first)
    return drain(decode)[request_id], export.data.shape[0]


def test_the_second_turn_ships_only_the_blocks_the_decode_engine_lacks(checkpoint: Path) -> None:
    alone = make_engine(checkpoint)
    prefill, decode = make_engine(checkpoint, budget=7), make_engine(checkpoint)
    answer, shipped = disaggregated_turn(prefill, decode, FIRST_TURN, "turn-1")
    assert answer == alone.generate([FIRST_TURN], GREEDY)[0].token_ids
    assert shipped == 11  # nothing cached yet: every block of the 41 tokens
    second_turn = FIRST_TURN + answer + list(range(300, 320))  # 85 tokens, 22 blocks
    answer, shipped = disaggregated_turn(prefill, decode, second_turn, "turn-2")
    assert answer == alone.generate([second_turn], GREEDY)[0].token_ids
    # The decode engine computed 41 + 23 = 64 tokens of turn 1: 16 full blocks stay cached.
    assert shipped == 22 - 16
    assert decode.stats().num_reused_prompt_tokens == 64
    assert_pool_whole(prefill)
    assert_pool_whole(decode)


def test_the_reused_blocks_are_shared_not_copied_and_the_landed_ones_follow_them(checkpoint: Path) -> None:
    prefill, decode = make_engine(checkpoint, budget=7), make_engine(checkpoint)
    answer, _ = disaggregated_turn(prefill, decode, FIRST_TURN, "turn-1")
    cached_ids = {block.block_id for block in decode.kv_cache.pool.cached.values()}
    second_turn = FIRST_TURN + answer + [7] * 9
    reservation = decode.reserve_prompt(second_turn, GREEDY, request_id="turn-2")
    assert reservation is not None and reservation.num_reused_blocks == 16
    first = run_prefill(prefill, second_turn, "turn-2")
    export = prefill.export_kv("turn-2", reservation.num_reused_blocks)
    decode.import_kv("turn-2", export.data.clone())
    assert torch.equal(decode.runner.read_blocks(reservation.block_ids[16:]), export.data)  # bit for bit, in place
    assert set(reservation.block_ids[:16]) <= cached_ids and not set(reservation.block_ids[16:]) & cached_ids
    prefill.release_held("turn-2")
    decode.admit_remote("turn-2", first)
    drain(decode)
    assert_pool_whole(decode)


def test_a_short_uncached_rest_is_prefilled_on_the_decode_engine(checkpoint: Path) -> None:
    alone = make_engine(checkpoint)
    prefill, decode = make_engine(checkpoint, budget=7), make_engine(checkpoint)
    answer, _ = disaggregated_turn(prefill, decode, FIRST_TURN, "turn-1")
    second_turn = FIRST_TURN + answer + [9, 10, 11]  # 68 tokens, 64 cached: 4 to compute
    reservation = decode.reserve_prompt(second_turn, GREEDY, request_id="turn-2", local_prefill_below=8)
    assert reservation is not None and reservation.local and reservation.num_reused_blocks == 16
    assert drain(decode)["turn-2"] == alone.generate([second_turn], GREEDY)[0].token_ids
    stats = decode.stats()
    assert (stats.num_local_prefills, stats.num_reused_prompt_tokens) == (1, 64)
    assert_pool_whole(decode)


def test_a_long_uncached_rest_still_goes_to_the_prefill_engine(checkpoint: Path) -> None:
    decode = make_engine(checkpoint)
    reservation = decode.reserve_prompt(FIRST_TURN, GREEDY, request_id="new", local_prefill_below=8)
    assert reservation is not None and not reservation.local and reservation.num_to_receive == 11
    decode.abort("new")
    assert_pool_whole(decode)


@pytest.mark.parametrize("ending", ["abort", "lease_ends", "fail_remote"])
def test_a_reservation_on_reused_blocks_ending_early_gives_every_block_back(checkpoint: Path, ending: str) -> None:
    prefill, decode = make_engine(checkpoint, budget=7), make_engine(checkpoint)
    answer, _ = disaggregated_turn(prefill, decode, FIRST_TURN, "turn-1")
    second_turn = FIRST_TURN + answer + list(range(300, 320))
    lease_s = 0.0 if ending == "lease_ends" else 30.0
    reservation = decode.reserve_prompt(second_turn, GREEDY, request_id="turn-2", lease_s=lease_s)
    assert reservation is not None and reservation.num_reused_blocks == 16
    if ending == "abort":
        decode.abort("turn-2")
    elif ending == "fail_remote":
        decode.fail_remote("turn-2", 5)  # computed here after the prefill's first token
        drain(decode)
    else:
        decode.step()  # the lease ended: parked without blocks until the router says the first token
        decode.settle_remote("turn-2", None)
        drain(decode)
    assert_pool_whole(decode)
    assert len(decode.kv_cache.pool.cached) >= 16  # the conversation's blocks are still cached, free


def test_a_request_owed_prompt_logprobs_is_never_prefilled_on_the_decode_engine(checkpoint: Path) -> None:
    decode = make_engine(checkpoint)
    params = replace(GREEDY, prompt_logprobs=1)  # the prefill worker computes every prompt position's
    reservation = decode.reserve_prompt([5, 6, 7], params, request_id="short", local_prefill_below=8)
    assert reservation is not None and not reservation.local
    decode.abort("short")
    assert_pool_whole(decode)
