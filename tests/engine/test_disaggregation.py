"""The engine's disaggregation hooks: a prefill engine hands a prompt's KV to a decode engine.

Two engines in one process stand for the two workers; the KV moves as a tensor (the transport is
tested in tests/transfer). Outputs must equal the engine alone, and no block may leak on any path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_engine_outputs import GREEDY, PROMPTS, assert_pool_whole
from tests.helpers import fp32_model, until_idle


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def make_engine(path: Path, num_blocks: int = 128, budget: int = 2048) -> LLMEngine:
    return LLMEngine(EngineConfig(model=fp32_model(path),
                                  cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def run_prefill(engine: LLMEngine, prompt: list[int], request_id: str, params: SamplingParams = GREEDY) -> int:
    engine.add_prefill(prompt, SamplingParams(max_tokens=1, temperature=params.temperature, ignore_eos=True),
                       request_id=request_id)
    for _ in until_idle(engine):
        outputs = engine.step()
    (output,) = outputs
    return output.token_ids[0]


def move_kv(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], request_id: str) -> tuple[int, torch.Tensor]:
    """Reserve on `decode`, prefill on `prefill`, import its exported KV; the first token and the export.
    The landed blocks equal the export bit for bit."""
    block_ids = decode.reserve_remote(prompt, GREEDY, request_id=request_id)
    assert block_ids is not None
    first = run_prefill(prefill, prompt, request_id)
    export = prefill.export_kv(request_id)
    decode.import_kv(request_id, export.data.clone())
    prefill.release_held(request_id)
    assert torch.equal(decode.runner.read_blocks(block_ids), export.data)  # bit for bit
    return first, export.data


def drain(engine: LLMEngine) -> dict[str, list[int]]:
    results = {}
    for _ in until_idle(engine):
        for output in engine.step():
            if output.finished:
                results[output.request_id] = list(output.token_ids)
    return results


def by_token(blocks: torch.Tensor) -> torch.Tensor:
    """[blocks, layers, 2, block_size, ...] -> [tokens, layers, 2, ...]."""
    return blocks.transpose(1, 3).flatten(0, 1)


def test_disaggregated_greedy_equals_engine_alone_and_kv_is_bit_exact(checkpoint: Path) -> None:
    alone = make_engine(checkpoint)
    expected = {f"r{i}": alone.generate([p], GREEDY)[0].token_ids for i, p in enumerate(PROMPTS)}
    prefill, decode = make_engine(checkpoint, budget=7), make_engine(checkpoint)
    for index, prompt in enumerate(PROMPTS):
        request_id = f"r{index}"
        first, _ = move_kv(prefill, decode, prompt, request_id)
        decode.admit_remote(request_id, first)
        if index % 2:
            decode.step()  # staggered: some arrive while others decode
    assert drain(decode) == expected
    assert_pool_whole(prefill)
    assert_pool_whole(decode)


def test_exported_kv_equals_kv_computed_by_a_local_engine(checkpoint: Path) -> None:
    prefill, local = make_engine(checkpoint, budget=5), make_engine(checkpoint)
    prompt = PROMPTS[3]
    run_prefill(prefill, prompt, "a")
    local.add_request(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), request_id="b")
    local.step()
    tokens = len(prompt)
    exported = by_token(prefill.export_kv("a").data)[:tokens]
    computed = by_token(local.runner.read_blocks(local.kv_cache.block_ids("b")))[:tokens]
    torch.testing.assert_close(exported, computed, atol=1e-5, rtol=1e-5)  # chunked vs whole prefill
    prefill.release_held("a")
    local.abort("b")
    assert_pool_whole(prefill)
    assert_pool_whole(local)


def test_expired_lease_recomputes_locally_with_the_same_output(checkpoint: Path) -> None:
    alone = make_engine(checkpoint)
    expected = alone.generate([PROMPTS[0]], GREEDY)[0].token_ids
    decode = make_engine(checkpoint)
    assert decode.reserve_remote(PROMPTS[0], GREEDY, request_id="late", lease_s=0.0) is not None
    decode.step()  # the lease ends: parked until its router says the client has no first token
    assert decode.settle_remote("late", None) is None
    assert drain(decode) == {"late": expected}
    assert_pool_whole(decode)


def test_failed_transfer_falls_back_to_recompute(checkpoint: Path) -> None:
    decode = make_engine(checkpoint)
    expected = decode.generate([PROMPTS[1]], GREEDY)[0].token_ids
    decode.reserve_remote(PROMPTS[1], GREEDY, request_id="x")
    decode.fail_remote("x")
    assert drain(decode) == {"x": expected}
    assert_pool_whole(decode)


def test_aborts_on_either_side_free_every_block(checkpoint: Path) -> None:
    prefill, decode = make_engine(checkpoint), make_engine(checkpoint)
    decode.reserve_remote(PROMPTS[0], GREEDY, request_id="gone")
    run_prefill(prefill, PROMPTS[0], "gone")
    assert prefill.abort("gone") and decode.abort("gone")
    decode.reserve_remote(PROMPTS[1], GREEDY, request_id="ready")
    decode.import_kv("ready", torch.zeros_like(decode.runner.read_blocks(decode.kv_cache.block_ids("ready"))))
    decode.admit_remote("ready", 5)
    assert decode.abort("ready")
    prefill.add_prefill(PROMPTS[2], GREEDY, request_id="mid")
    prefill.step()
    assert prefill.abort("mid")
    assert not decode.has_unfinished_requests() and not prefill.has_unfinished_requests()
    assert_pool_whole(prefill)
    assert_pool_whole(decode)


def test_reservation_refused_when_the_pool_is_full(checkpoint: Path) -> None:
    decode = make_engine(checkpoint, num_blocks=12)
    assert decode.reserve_remote(PROMPTS[3], GREEDY, request_id="big") is not None  # 9 of 12 blocks
    assert decode.reserve_remote(PROMPTS[3], GREEDY, request_id="refused") is None
    assert "refused" not in decode.scheduler.requests
    decode.abort("big")
    assert_pool_whole(decode)


def test_bad_kv_shape_is_rejected(checkpoint: Path) -> None:
    decode = make_engine(checkpoint)
    decode.reserve_remote(PROMPTS[2], GREEDY, request_id="r")
    with pytest.raises(ValueError, match="does not fit"):
        decode.import_kv("r", torch.zeros(3, 3))
    with pytest.raises(ValueError, match="no reservation"):
        decode.import_kv("unknown", torch.zeros(3, 3))
    decode.abort("r")
    assert_pool_whole(decode)


def test_a_first_token_that_ends_the_request_finishes_it_on_the_decode_side(checkpoint: Path) -> None:
    """The prefill's token may be the last (max_tokens 1, EOS, a stop token id): the decode worker
    answers it as finished at once and keeps nothing."""
    prefill, decode = make_engine(checkpoint), make_engine(checkpoint)
    prompt = PROMPTS[0]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    assert decode.reserve_remote(prompt, one, request_id="one") is not None
    first = run_prefill(prefill, prompt, "one", one)
    decode.import_kv("one", prefill.export_kv("one").data.clone())
    prefill.release_held("one")
    output = decode.admit_remote("one", first)
    assert output.finished and output.token_ids == [first] and output.finish_reason == "length"
    assert not decode.has_unfinished_requests() and not decode.detokenizers
    assert_pool_whole(decode)
    assert_pool_whole(prefill)
