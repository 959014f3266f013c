"""Speculative decoding with a draft model: a smaller model of the same vocabulary proposes its greedy
continuation, the served model verifies it. Greedy tokens are those without speculation whatever the
draft; a draft equal to the served model has every draft accepted (so the drafts are its next tokens,
at the right positions); sampled tokens keep the served model's distribution; both engines' blocks all
come back."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import SpeculativeConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.spec_decode import DraftModelProposer
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.conftest import PlainMarginals
from tests.engine.test_spec_decode import (
    GREEDY,
    RANDOM,
    REPETITIVE,
    make_engine,
    run,
    sampled_marginals,
    tokens,
    total_variation,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("target"), num_layers=2, hidden=64, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random model of the same vocabulary: a poor draft, rejected often."""
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("draft"), num_layers=1, hidden=32, heads=2, kv_heads=1,
                                       seed=7)


def draft_model(path: Path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"model": str(path), "num_speculative_tokens": k})


def draft_engine(engine: LLMEngine) -> LLMEngine:
    proposer = engine.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer.engine


def test_the_config_takes_vllms_draft_model_form(draft: Path) -> None:
    assert draft_model(draft).method == "draft_model"
    assert SpeculativeConfig.from_dict({"method": "draft_model", "model": "x", "num_speculative_tokens": 2}).enabled
    for bad, message in [({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft's checkpoint"),
                         ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "ngram method's")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(bad)


def test_greedy_tokens_are_those_without_speculation(target: Path, draft: Path) -> None:
    prompts = REPETITIVE + RANDOM
    plain = run(make_engine(target), prompts)
    engine = make_engine(target, draft_model(draft))
    assert tokens(run(engine, prompts)) == tokens(plain)
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens > stats.num_accepted_tokens
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks
    drafts = draft_engine(engine)
    assert not drafts.has_unfinished_requests()
    assert drafts.kv_cache.pool.num_free_blocks == drafts.kv_cache.pool.num_blocks


def test_a_draft_equal_to_the_served_model_has_every_draft_accepted(target: Path) -> None:
    """The draft's greedy tokens are the served model's (deterministic mode: the same numbers as a
    decode or inside a row of drafts), so a proposer that drafted from the wrong position, dropped or
    repeated a token would see drafts rejected."""
    prompts = REPETITIVE + RANDOM
    plain = run(make_engine(target), prompts)
    engine = make_engine(target, draft_model(target, k=3))
    assert tokens(run(engine, prompts)) == tokens(plain)
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens == stats.num_accepted_tokens > 0
    # About four tokens a step: 1 + 3 accepted drafts (fewer where max_tokens cuts the drafts).
    assert stats.num_drafts < len(prompts) * GREEDY.max_tokens / 3


def test_preemption_and_a_small_draft_pool_keep_the_tokens(target: Path, draft: Path) -> None:
    prompts = REPETITIVE + RANDOM + REPETITIVE
    plain = run(make_engine(target), prompts)
    engine = make_engine(target, draft_model(target), num_blocks=40, budget=48)
    assert tokens(run(engine, prompts)) == tokens(plain)
    assert engine.stats().num_preemptions > 0
    assert engine.stats().spec_decode.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks


@pytest.fixture(scope="module")
def tiny_vocab_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random model of 8 tokens (the served one is `tiny_vocab`), as its draft."""
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("vocab8-draft"), num_layers=1, hidden=32, heads=2,
                                       kv_heads=1, vocab=8, seed=3)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2, ignore_eos=True),
], ids=["plain", "filtered"])
def test_sampled_tokens_keep_the_models_distribution(tiny_vocab: Path, tiny_vocab_draft: Path,
                                                      plain_marginals: PlainMarginals, params: SamplingParams) -> None:
    """3,000 samples with a draft model against 4,000 without (test_spec_decode's, drawn once): at every
    drafted position the empirical distributions are within a total variation of 0.05 (sampling noise
    is about 0.02; accepting every draft moves them by far more)."""
    plain = plain_marginals(params)
    speculative, engine = sampled_marginals(tiny_vocab, draft_model(tiny_vocab_draft, k=3), params, 3000)
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens > stats.num_accepted_tokens > 0
    distances = [total_variation(a, b) for a, b in zip(plain[1:], speculative[1:], strict=True)]
    assert max(distances) < 0.05, distances
