"""Greedy outputs of the whole engine stay the same under every scheduling condition.

The reference is the engine with a large pool and budget; every other configuration (small token
budgets that chunk prefills, undersized pools that force preemption by recompute or swap, prefix
cache hits, no prefix cache, bfloat16 checks aside) must produce exactly the same tokens.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

PROMPTS = [
    [5, 17, 33, 9, 81, 120, 7, 7, 64, 11, 3, 250, 199, 42, 42, 18, 77],
    [5, 17, 33, 9, 81, 120, 7, 7, 64, 11, 3, 250, 100, 101, 102, 103, 104, 105, 106, 12, 13, 14],
    [200, 201, 202],
    [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113,
     114, 115, 116, 117, 118, 119, 120, 121, 122, 123],
    [44] * 9,
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"), num_layers=2, hidden=64, heads=4, kv_heads=2)


def make_engine(path: Path, *, num_blocks: int = 256, budget: int = 2048, mode: str = "recompute",
                prefix_caching: bool = True, max_num_seqs: int = 256, block_size: int = 4,
                kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=fp32_model(path),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching,
                          kv_cache_dtype=kv_cache_dtype),  # type: ignore[arg-type]
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, preemption_mode=mode,  # type: ignore[arg-type]
                                  max_num_seqs=max_num_seqs)))


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY,
                  ) -> list[list[int]]:
    """Add one request per step (staggered arrivals) and run everything to the end."""
    pending = list(enumerate(prompts))
    ids: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    for _ in range(2_000):  # bounded: a hang fails here
        if not pending and not engine.has_unfinished_requests():
            break
        if pending:
            index, prompt = pending.pop(0)
            ids[engine.add_request(prompt, params).request_id] = index
        for output in engine.step():
            if output.finished and output.request_id in ids:
                results[ids[output.request_id]] = list(output.token_ids)
    return [results[index] for index in range(len(prompts))]


def assert_pool_whole(engine: LLMEngine) -> None:
    pool = engine.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not engine.kv_cache.blocks_of and not engine.runner.swap_store and not engine.detokenizers


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    engine = make_engine(checkpoint)
    return [engine.generate([prompt], GREEDY)[0].token_ids for prompt in PROMPTS]


def test_batched_with_staggered_arrivals_equals_alone(checkpoint: Path, reference: list[list[int]]) -> None:
    engine = make_engine(checkpoint)
    assert run_staggered(engine, PROMPTS) == reference
    assert_pool_whole(engine)


@pytest.mark.parametrize("budget", [1, 3, 8])
def test_chunked_prefill_under_small_budgets_keeps_outputs(checkpoint: Path, reference: list[list[int]],
                                                           budget: int) -> None:
    engine = make_engine(checkpoint, budget=budget)
    assert run_staggered(engine, PROMPTS) == reference
    assert_pool_whole(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_undersized_pool_keeps_outputs(checkpoint: Path, reference: list[list[int]],
                                                       mode: str) -> None:
    engine = make_engine(checkpoint, num_blocks=24, mode=mode)
    assert run_staggered(engine, PROMPTS) == reference
    assert engine.scheduler.num_preemptions > 0
    assert_pool_whole(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_an_fp8_cache_keeps_its_outputs_through_preemption(checkpoint: Path, reference: list[list[int]],
                                                           mode: str) -> None:
    """An fp8 cache's bytes go out and come back whole through a swap (as bytes: torch's CPU index_put_
    takes no fp8), and a recompute writes them again: an undersized fp8 pool gives the tokens of a large
    fp8 pool, which differ from the fp32 cache's (so the cache really is fp8)."""
    large = make_engine(checkpoint, kv_cache_dtype="fp8")
    fp8_reference = [large.generate([prompt], GREEDY)[0].token_ids for prompt in PROMPTS]
    assert fp8_reference != reference
    engine = make_engine(checkpoint, num_blocks=24, mode=mode, kv_cache_dtype="fp8")
    assert run_staggered(engine, PROMPTS) == fp8_reference
    assert engine.scheduler.num_preemptions > 0
    assert_pool_whole(engine)


def test_prefix_cache_hits_keep_outputs(checkpoint: Path, reference: list[list[int]]) -> None:
    engine = make_engine(checkpoint)
    first = run_staggered(engine, PROMPTS)
    hits_before = engine.kv_cache.prefix_hits
    second = run_staggered(engine, PROMPTS)
    assert first == second == reference
    assert engine.kv_cache.prefix_hits > hits_before
    assert_pool_whole(engine)


def test_no_prefix_caching_keeps_outputs(checkpoint: Path, reference: list[list[int]]) -> None:
    engine = make_engine(checkpoint, prefix_caching=False, budget=5)
    assert run_staggered(engine, PROMPTS) == reference
    assert engine.kv_cache.prefix_hits == 0


def test_same_seed_same_output_whatever_the_batch(checkpoint: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    engine = make_engine(checkpoint)
    alone = engine.generate([PROMPTS[0]], params)[0].token_ids
    crowd = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    mixed = run_staggered(engine, crowd, SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True))
    engine.add_request(PROMPTS[3], SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True))
    together = run_staggered(engine, [PROMPTS[0]], params)[0]
    assert mixed  # the crowd ran
    assert together == alone


def test_a_seeded_run_resumed_after_its_tokens_goes_on_as_one_run(checkpoint: Path) -> None:
    """A request resumed elsewhere from prompt + the tokens already out, with `seed_offset` = their
    count, samples the very tokens one unbroken run does (what the router relies on)."""
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    engine = make_engine(checkpoint)
    whole = engine.generate([PROMPTS[1]], params)[0].token_ids
    rest = engine.generate([PROMPTS[1] + whole[:5]], replace(params, max_tokens=11, seed_offset=5))[0].token_ids
    assert whole[5:] == rest
    fresh = engine.generate([PROMPTS[1] + whole[:5]], replace(params, max_tokens=11))[0].token_ids
    assert fresh != rest  # without the offset the stream restarts: the offset is what keeps it


def test_abort_mid_generation_frees_every_block(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    requests = [engine.add_request(prompt, GREEDY) for prompt in PROMPTS]
    for _ in range(3):
        engine.step()
    for request in requests:
        engine.abort(request.request_id)
    assert not engine.has_unfinished_requests()
    assert_pool_whole(engine)
    assert engine.step() == []


def test_finish_reasons_and_stops(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    free_run = engine.generate([PROMPTS[0]], GREEDY)[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 24
    stop_token = free_run.token_ids[5]
    by_token = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                              stop_token_ids=(stop_token,)))[0]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == stop_token
    assert by_token.token_ids == free_run.token_ids[:free_run.token_ids.index(stop_token) + 1]
    text = free_run.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        by_string = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                                   stop=(stop,)))[0]
        assert by_string.finish_reason == "stop" and by_string.stop_reason == stop
        assert stop not in by_string.text and text.startswith(by_string.text)
    assert_pool_whole(engine)


def test_logprobs_are_returned_per_token(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3))
    outputs = [o for _ in range(10) for o in engine.step()]
    assert len(outputs) == 4
    for output in outputs:
        (entry,) = output.new_logprobs
        assert entry.token_id == output.new_token_ids[0]
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id  # greedy picks the most likely



@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_long_request_finishes_while_short_ones_keep_arriving(checkpoint: Path, mode: str) -> None:
    """KV exhaustion without deadlock or starvation: a request needing most of the pool is preempted
    (it was admitted last), then a short request arrives every step. Readmission is first come first
    served, so the new arrivals queue behind it and it finishes while they keep coming; every
    output is the one its prompt gets alone."""
    params = {"medium": SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              "long": SamplingParams(max_tokens=56, temperature=0, ignore_eos=True),  # 90 tokens: 23 blocks
              "short": SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)}
    prompts = {"medium": PROMPTS[0], "long": PROMPTS[3], "short-0": PROMPTS[1], "short-1": PROMPTS[2],
               "short-2": PROMPTS[4]}
    alone = make_engine(checkpoint)
    expected = {name: alone.generate([prompt], params[name.split("-")[0]])[0].token_ids
                for name, prompt in prompts.items()}
    engine = make_engine(checkpoint, num_blocks=26, budget=8, mode=mode)
    engine.add_request(prompts["medium"], params["medium"], request_id="medium")
    long = engine.add_request(prompts["long"], params["long"], request_id="long")
    results: dict[str, list[int]] = {}
    arrivals = 0
    for _ in range(5_000):  # far above the ~150 steps this takes: reaching it means a livelock
        if "long" not in results:  # a new short request every step until the long one is done
            name = f"short-{arrivals % 3}"
            engine.add_request(prompts[name], params["short"], request_id=f"{name}-{arrivals}")
            arrivals += 1
        for output in engine.step():
            if output.finished:
                results[output.request_id] = list(output.token_ids)
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests(), "requests left after the step bound"
    assert long.num_preemptions > 0
    assert len(results) == arrivals + 2
    assert all(tokens == expected[request_id.rsplit("-", 1)[0]] for request_id, tokens in results.items())
    assert_pool_whole(engine)
