"""The real default model: greedy tokens identical to transformers' `generate` on the same weights."""

from __future__ import annotations

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from tests.conftest import MAX_TOKENS
from tests.engine.test_engine_outputs import run_staggered

pytestmark = pytest.mark.slow


def test_the_model_knows_paris(default_engine: LLMEngine, default_prompts: list[list[int]]) -> None:
    output = default_engine.generate([default_prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
    assert output.text == "The capital of France is Paris."
    assert output.finish_reason == "stop"


def test_each_request_alone_matches_transformers(default_engine: LLMEngine, default_prompts: list[list[int]],
                                                 transformers_greedy: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    got = [default_engine.generate([prompt], params)[0].token_ids for prompt in default_prompts]
    assert got == transformers_greedy
    assert sum(len(tokens) >= 32 for tokens in got) >= 3  # real generations, not early stops


def test_all_together_with_staggered_arrivals_match_transformers(
        default_engine: LLMEngine, default_prompts: list[list[int]], transformers_greedy: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    assert run_staggered(default_engine, default_prompts, params) == transformers_greedy
    pool = default_engine.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
