"""Speculative decoding (n-gram drafts) through the whole engine: greedy tokens, their logprobs and
every stop condition are those of the engine without speculation, under prefix caching and
preemption; sampled tokens keep the model's distribution; the KV blocks all come back; the prefix
cache never serves a block that held a rejected draft; and the acceptance counters move."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from cluster.engine.llm_engine import LLMEngine, RequestOutput
from cluster.engine.spec_decode import ngram_lookup
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.conftest import PlainMarginals
from tests.helpers import fp32_model

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
REPETITIVE = [[7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9], [40, 41, 40, 41, 40, 41, 40], [5] * 12,
              [60, 61, 62, 63, 64, 65, 66, 60, 61, 62, 63, 64, 65]]
RANDOM = [[201, 13, 77, 150, 3, 98, 255, 31, 140], [17, 260, 33, 190]]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("spec"), num_layers=2, hidden=64, heads=4, kv_heads=2)


def make_engine(path: Path, speculative: SpeculativeConfig | None = None, *, num_blocks: int = 512,
                budget: int = 2048, deterministic: bool = True, prefix_caching: bool = True) -> LLMEngine:
    """Deterministic mode: a token's numbers do not depend on whether it ran as a decode or inside a
    row of drafts, so greedy tokens and logprobs compare exactly."""
    return LLMEngine(EngineConfig(
        model=fp32_model(path, deterministic=deterministic),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        speculative=speculative or SpeculativeConfig()))


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY,
        ) -> list[RequestOutput]:
    """Every prompt to its end, the last output of each; every step's new tokens must add up."""
    all_params = params if isinstance(params, list) else [params] * len(prompts)
    requests = [engine.add_request(prompt, p) for prompt, p in zip(prompts, all_params, strict=True)]
    final: dict[str, RequestOutput] = {}
    streamed: dict[str, list[int]] = {}
    for _ in range(5_000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            assert output.index == len(streamed.setdefault(output.request_id, []))
            streamed[output.request_id] += output.new_token_ids
            if output.finished:
                final[output.request_id] = output
    for request in requests:
        assert streamed[request.request_id] == final[request.request_id].token_ids
    return [final[request.request_id] for request in requests]


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [list(output.token_ids) for output in outputs]


# ---- the n-gram proposer ----------------------------------------------------------------------

def test_ngram_lookup_proposes_what_followed_the_longest_earliest_match() -> None:
    assert ngram_lookup([1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3], 1, 3, 3) == [9, 2, 3]  # "1 2 3" beats the later "2 3"
    assert ngram_lookup([1, 2, 3, 4, 1, 2, 3, 5, 2, 3], 1, 3, 2) == [4, 1]  # "2 3" twice: the earliest
    assert ngram_lookup([1, 2, 3, 4, 1, 2, 3, 5, 2, 3], 1, 3, 9) == [4, 1, 2, 3, 5, 2, 3]  # runs to the end
    assert ngram_lookup([1, 2, 3, 4, 5, 3], 2, 3, 3) == []  # only a 1-gram matches: below the minimum
    assert ngram_lookup([1, 2, 3, 4, 5, 3], 1, 3, 3) == [4, 5, 3]
    assert ngram_lookup([5, 5, 5, 5], 1, 2, 3) == [5, 5]  # overlapping matches count
    assert ngram_lookup([1, 2, 3], 1, 3, 3) == [] and ngram_lookup([4], 1, 3, 3) == []


def test_the_speculative_config_resolves_lookup_bounds_as_vllm_does() -> None:
    assert (SpeculativeConfig(method="ngram", num_speculative_tokens=3).prompt_lookup_min,
            SpeculativeConfig(method="ngram", num_speculative_tokens=3).prompt_lookup_max) == (5, 5)
    only_max = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    assert not SpeculativeConfig().enabled and only_max.enabled
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).num_speculative_tokens == 2
    cases: list[tuple[dict[str, object], str]] = [({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                         ({"method": "ngram"}, "num_speculative_tokens must be >= 1"),
                         ({"num_speculative_tokens": 2}, "needs a speculative method"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                           "prompt_lookup_max": 2}, "prompt_lookup_min"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "draft_model method")]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(bad)


# ---- greedy: the same tokens ------------------------------------------------------------------

def test_greedy_tokens_are_those_without_speculation(checkpoint: Path) -> None:
    """Repetitive prompts (drafts accepted) and random ones (drafts rejected or none), together in
    one batch: every token as without speculation; drafts were both accepted and rejected, at
    several positions, and every block is back in the pool."""
    plain = run(make_engine(checkpoint), REPETITIVE + RANDOM)
    engine = make_engine(checkpoint, NGRAM)
    assert tokens(run(engine, REPETITIVE + RANDOM)) == tokens(plain)
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens and stats.accepted_per_position[1] > 0
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks


def test_greedy_logprobs_are_one_per_token_and_the_same(checkpoint: Path) -> None:
    params = replace(GREEDY, logprobs=2, max_tokens=24)
    plain = make_engine(checkpoint)
    engine = make_engine(checkpoint, NGRAM)
    expected = run_logprobs(plain, REPETITIVE, params)
    assert run_logprobs(engine, REPETITIVE, params) == expected
    assert all(len(entries) == 24 for entries in expected)
    assert engine.stats().spec_decode.num_accepted_tokens > 0  # type: ignore[union-attr]


def run_logprobs(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[tuple]]:
    found: dict[str, list[tuple]] = {}
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert len(output.new_logprobs) == len(output.new_token_ids)
            found.setdefault(output.request_id, []).extend(
                (entry.token_id, entry.logprob, tuple(entry.top)) for entry in output.new_logprobs)
    return [found[request.request_id] for request in requests]


RUN = [5] * 12  # this model answers it with a long run of one token: drafts accepted, four at a time


@pytest.mark.parametrize("stop", ["max_tokens", "context", "penalties", "min_tokens"])
def test_every_stop_condition_and_penalty_inside_accepted_drafts(checkpoint: Path, stop: str) -> None:
    """A stop met inside a row of accepted drafts ends the request there, as without speculation:
    the tokens after it are dropped. Penalties and min_tokens see each draft position's own history."""
    reference = run(make_engine(checkpoint), [RUN])[0]
    assert len(set(reference.token_ids[:20])) == 1, "the run this test is built on"
    params = stop_params(stop, reference)
    prompts = [RUN, *REPETITIVE]
    plain_engine, engine = make_engine(checkpoint), make_engine(checkpoint, NGRAM)
    if stop == "context":
        for each in (plain_engine, engine):
            each.max_model_len = each.scheduler.max_model_len = 30
    plain = run(plain_engine, prompts, params)
    speculative = run(engine, prompts, params)
    assert tokens(speculative) == tokens(plain)
    assert [(o.text, o.finish_reason, o.stop_reason) for o in speculative] == \
        [(o.text, o.finish_reason, o.stop_reason) for o in plain]
    if stop in ("max_tokens", "context"):
        assert len(plain[0].token_ids) == {"max_tokens": 19, "context": 30 - len(RUN)}[stop]
        assert engine.stats().spec_decode.num_accepted_tokens >= 8  # type: ignore[union-attr]
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks


def stop_params(stop: str, reference: RequestOutput) -> SamplingParams:
    """A stop that falls in the middle of the run."""
    if stop == "max_tokens":
        return replace(GREEDY, max_tokens=19)
    if stop == "penalties":
        return replace(GREEDY, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    if stop == "min_tokens":  # the run's token stops it, once 6 tokens are out (masked before)
        return replace(GREEDY, stop_token_ids=(reference.token_ids[0],), min_tokens=6)
    return GREEDY


def test_a_stop_string_inside_accepted_drafts_drops_the_tokens_after_it(checkpoint: Path) -> None:
    """The detokenizer sees a step's tokens one by one: a stop string that ends at the second of
    three accepted tokens ends the request there, the third taken back from its output."""
    engine = make_engine(checkpoint, NGRAM)
    letters = [token for token in range(3, 320) if engine.tokenizer.decode([token]).isalpha()][:3]
    stop = engine.tokenizer.decode(letters[:2])
    request = engine.add_request(RANDOM[0], replace(GREEDY, stop=(stop,)))
    engine.step()  # the prompt and its first token
    for token in letters:  # three tokens of one step, as the scheduler appends them
        request.append_output_token(token)
    output = engine._output(request, letters, [])
    assert output.new_token_ids == letters[:2] and request.output_token_ids[1:] == letters[:2]
    assert output.finished and output.stop_reason == stop and output.finish_reason == "stop"
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks


def test_prefix_caching_and_preemption_keep_the_tokens_and_free_every_block(checkpoint: Path) -> None:
    """A pool too small for every request at once (preemption by recompute), prefix caching on: the
    same tokens as without speculation, and every block back in the pool at the end."""
    prompts = REPETITIVE + RANDOM + REPETITIVE
    plain = run(make_engine(checkpoint), prompts)
    engine = make_engine(checkpoint, NGRAM, num_blocks=40, budget=48)
    assert tokens(run(engine, prompts)) == tokens(plain)
    assert engine.stats().num_preemptions > 0 and engine.stats().spec_decode.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks


def test_the_prefix_cache_serves_only_real_tokens_kv(checkpoint: Path) -> None:
    """After a speculative run, every cached block is looked up again by prompts that are the first
    runs' whole sequences: their next tokens (computed over the cached KV) are a fresh engine's, so
    no cached block held a rejected draft's KV under a real token's hash."""
    engine = make_engine(checkpoint, NGRAM)
    first = run(engine, REPETITIVE + RANDOM)
    rejected = engine.stats().spec_decode
    assert rejected is not None and rejected.num_draft_tokens > rejected.num_accepted_tokens
    sequences = [prompt + list(output.token_ids) for prompt, output in zip(REPETITIVE + RANDOM, first, strict=True)]
    hits_before = engine.kv_cache.prefix_hits
    again = run(engine, sequences, replace(GREEDY, max_tokens=3))
    assert engine.kv_cache.prefix_hits - hits_before >= sum(len(s) // 4 - 1 for s in sequences) * 4
    assert tokens(again) == tokens(run(make_engine(checkpoint, prefix_caching=False), sequences,
                                       replace(GREEDY, max_tokens=3)))


def test_default_mode_greedy_tokens_match_too(checkpoint: Path) -> None:
    """Without deterministic mode a row of drafts runs through other kernels than a decode; on this
    model in fp32 the argmax is the same all the same."""
    plain = run(make_engine(checkpoint, deterministic=False), REPETITIVE + RANDOM)
    engine = make_engine(checkpoint, NGRAM, deterministic=False)
    assert tokens(run(engine, REPETITIVE + RANDOM)) == tokens(plain)
    assert engine.stats().spec_decode.num_accepted_tokens > 0  # type: ignore[union-attr]


def test_budget_counts_the_drafts(checkpoint: Path) -> None:
    """Each step's batched tokens include the drafts, within max_num_batched_tokens; a budget of one
    token runs no drafts at all."""
    engine = make_engine(checkpoint, NGRAM, budget=6)
    for prompt in REPETITIVE:
        engine.add_request(prompt, GREEDY)
    steps = []
    while engine.has_unfinished_requests():
        output = engine.scheduler.schedule()
        steps.append((output.num_batched_tokens, sum(s.num_new_tokens for s in output.scheduled),
                      sum(len(s.draft_token_ids) for s in output.scheduled)))
        if output.empty:
            continue
        runner_output = engine.runner.execute(output)
        engine.scheduler.update_from_output(output, runner_output.sampled)
        engine._propose(output)
    assert all(batched == total <= 6 for batched, total, _ in steps)
    assert any(drafts > 0 for _, _, drafts in steps)
    tight = make_engine(checkpoint, NGRAM, budget=1)
    run(tight, REPETITIVE[:1])
    assert tight.stats().spec_decode.num_drafts == 0  # type: ignore[union-attr]


def test_constrained_requests_get_no_drafts(checkpoint: Path) -> None:
    engine = make_engine(checkpoint, NGRAM)
    request = engine.add_request(RUN, GREEDY)
    for _ in range(3):
        engine.step()
    assert request.draft_token_ids  # unconstrained: drafted
    object.__setattr__(request, "grammar", object())  # any matcher: the proposer only looks whether there is one
    engine._propose(engine.scheduler.schedule())
    assert request.draft_token_ids == []


# ---- sampling: the same distribution ---------------------------------------------------------

def sampled_marginals(path: Path, speculative: SpeculativeConfig, params: SamplingParams, samples: int,
                      ) -> tuple[list[Counter[int]], LLMEngine]:
    torch.manual_seed(0)
    engine = LLMEngine(EngineConfig(model=fp32_model(path), cache=CacheConfig(block_size=4, num_blocks=8192),
                                    scheduler=SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192),
                                    speculative=speculative))
    outputs = run(engine, [[3, 4, 5, 3, 4, 5, 3, 4]] * samples, params)
    counts = [Counter(output.token_ids[position] for output in outputs) for position in range(params.max_tokens)]
    return counts, engine


def total_variation(a: Counter[int], b: Counter[int]) -> float:
    total_a, total_b = sum(a.values()), sum(b.values())
    return sum(abs(a[k] / total_a - b[k] / total_b) for k in set(a) | set(b)) / 2


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True),
    SamplingParams(max_tokens=4, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.2, ignore_eos=True),
], ids=["plain", "filtered"])
def test_sampled_tokens_keep_the_models_distribution(tiny_vocab: Path, plain_marginals: PlainMarginals,
                                                      params: SamplingParams) -> None:
    """4,000 samples of the same prompt with and without speculation: at every drafted position the
    two empirical distributions are within a total variation of 0.05 (sampling noise is about 0.02;
    accepting every draft, or drawing a rejected draft's replacement from p with the draft left in,
    moves them by 0.1 and more). The samples without speculation are shared with test_draft_model."""
    plain = plain_marginals(params)
    speculative, engine = sampled_marginals(tiny_vocab, replace(NGRAM, num_speculative_tokens=3), params, 4000)
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_draft_tokens > 2 * stats.num_accepted_tokens > 0
    distances = [total_variation(a, b) for a, b in zip(plain[1:], speculative[1:], strict=True)]
    assert max(distances) < 0.05, distances
