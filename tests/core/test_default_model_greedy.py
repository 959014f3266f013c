"""The real default model: greedy tokens identical to transformers' `generate` on the same weights."""

from __future__ import annotations

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.sampling_params import SamplingParams
from tests.core.test_engine_outputs import run_staggered

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig())


@pytest.fixture(scope="module")
def prompts(engine: LLMEngine) -> list[list[int]]:
    return [engine.chat_prompt([{"role": "user", "content": question}]) for question in QUESTIONS]


@pytest.fixture(scope="module")
def expected(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    import transformers

    oracle = transformers.AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            generated = oracle.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                        eos_token_id=list(engine.tokenizer.eos_token_ids), pad_token_id=0)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def test_the_model_knows_paris(engine: LLMEngine, prompts: list[list[int]]) -> None:
    output = engine.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0]
    assert output.text == "The capital of France is Paris."
    assert output.finish_reason == "stop"


def test_each_request_alone_matches_transformers(engine: LLMEngine, prompts: list[list[int]],
                                                 expected: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    got = [engine.generate([prompt], params)[0].token_ids for prompt in prompts]
    assert got == expected
    assert sum(len(tokens) >= 32 for tokens in got) >= 3  # real generations, not early stops


def test_all_together_with_staggered_arrivals_match_transformers(engine: LLMEngine, prompts: list[list[int]],
                                                                 expected: list[list[int]]) -> None:
    assert run_staggered(engine, prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)) == expected
    pool = engine.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
