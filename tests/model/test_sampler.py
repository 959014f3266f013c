"""The sampler against vLLM's semantics: processing order, filters, seeds, penalties, logprobs.

Every random draw comes from a fixed seed, so the statistical checks are deterministic.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.common.sampling_params import SamplingParams
from cluster.common.structured_output import StructuredOutput
from cluster.engine.request import Request
from cluster.grammar.compiler import GrammarCompiler
from cluster.model.grammar_masks import GrammarMasker
from cluster.model.sampler import TOP_P_PREFIX, Sampler, apply_penalties, process_logits, top_k_top_p_cutoffs
from cluster.weights.synthetic import build_tiny_tokenizer
from cluster.weights.tokenizer import Tokenizer

EOS = 0


def make_request(
    request_id: str,
    params: SamplingParams,
    prompt: Sequence[int] = (1, 2, 3),
    outputs: Sequence[int] = (),
) -> Request:
    request = Request(request_id, list(prompt), params, eos_token_ids=(EOS,))
    for token in outputs:
        request.append_output_token(token)
    return request


def random_logits(rows: int, vocab_size: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


def reference_filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """vLLM's top-k/top-p (full ascending sort) then min-p, written plainly for one row."""
    vocab_size = logits.shape[-1]
    k = top_k if 0 < top_k < vocab_size else vocab_size
    ascending, order = logits.sort()
    ascending = ascending.masked_fill(ascending < ascending[vocab_size - k], float("-inf"))
    dropped = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    dropped[-1] = False
    filtered = torch.empty_like(logits).scatter_(0, order, ascending.masked_fill(dropped, float("-inf")))
    probs = filtered.softmax(-1)
    return filtered.masked_fill(probs < min_p * probs.max(), float("-inf"))


def chi_square(counts: Counter[int], expected: torch.Tensor) -> float:
    total = sum(counts.values())
    assert all(expected[token] > 0 for token in counts), "sampled a token of probability 0"
    support = (expected > 0).nonzero().squeeze(1).tolist()
    return sum((counts[t] - total * float(expected[t])) ** 2 / (total * float(expected[t])) for t in support)


# Greedy and its equivalents.


def test_greedy_is_argmax_for_float32_and_bfloat16() -> None:
    logits = random_logits(8, 100, seed=0)
    requests = [make_request(f"r{i}", SamplingParams(temperature=0)) for i in range(8)]
    sampler = Sampler(100)
    assert sampler(logits, requests).token_ids == logits.argmax(-1).tolist()
    bf16 = logits.bfloat16()
    assert sampler(bf16, requests).token_ids == bf16.float().argmax(-1).tolist()


def test_greedy_on_bfloat16_logits_is_exactly_the_widened_argmax_ties_included() -> None:
    """The runner hands bf16 logits over unwidened: greedy rows (all greedy, or mixed with random
    ones) pick what argmax over the fp32 copy picks, first of tied maxima included."""
    logits = (random_logits(6, 300, seed=9) * 0.1).bfloat16()  # bf16's coarse steps: many ties
    logits[0, [7, 250]] = 5.0
    logits[1, :] = 0.5
    widened = logits.float()
    assert logits.stride(-1) == 1
    greedy = [make_request(f"g{i}", SamplingParams(temperature=0)) for i in range(6)]
    sampler = Sampler(300, seed=0)
    assert sampler(logits, greedy).token_ids == widened.argmax(-1).tolist()
    assert sampler(logits, greedy).token_ids[:2] == [7, 0]
    mixed = greedy[:3] + [make_request(f"s{i}", SamplingParams(temperature=1.0)) for i in range(3)]
    assert sampler(logits, mixed).token_ids[:3] == widened[:3].argmax(-1).tolist()


def test_padded_vocabulary_columns_are_never_sampled() -> None:
    logits = torch.cat([random_logits(4, 50, seed=1), torch.full((4, 14), 100.0)], dim=1)
    greedy = [make_request(f"g{i}", SamplingParams(temperature=0)) for i in range(2)]
    random = [make_request(f"s{i}", SamplingParams(temperature=2.0)) for i in range(2)]
    tokens = Sampler(50, seed=0)(logits, greedy + random).token_ids
    assert all(0 <= token < 50 for token in tokens)
    assert tokens[:2] == logits[:2, :50].argmax(-1).tolist()


def test_temperature_of_exactly_the_greedy_threshold_still_samples() -> None:
    """Greedy is temperature strictly below 1e-5, as in vLLM (and SamplingParams.is_greedy): at 1e-5
    itself two logits 1e-5 apart are 1 apart after tempering, so the lower one is still drawn."""
    logits = torch.tensor([[0.0, 1e-5]]).expand(200, -1)
    requests = [make_request(f"r{i}", SamplingParams(temperature=1e-5)) for i in range(200)]
    assert set(Sampler(2, seed=0)(logits, requests).token_ids) == {0, 1}


def test_a_one_token_vocabulary_is_valid_and_an_empty_one_is_refused() -> None:
    requests = [make_request("g", SamplingParams(temperature=0)), make_request("s", SamplingParams())]
    assert Sampler(1, seed=0)(torch.zeros(2, 1), requests).token_ids == [0, 0]
    with pytest.raises(ValueError, match=r"vocab_size must be >= 1, got 0"):
        Sampler(0)


def test_all_greedy_without_processing_makes_no_copy() -> None:
    logits = random_logits(4, 30, seed=2)
    requests = [make_request(f"r{i}", SamplingParams(temperature=0)) for i in range(4)]
    assert process_logits(logits, requests) is logits


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6)])
def test_top_k_one_and_tiny_top_p_sample_the_argmax(params: SamplingParams) -> None:
    logits = random_logits(32, 500, seed=3, scale=1.0)
    requests = [make_request(f"r{i}", params) for i in range(32)]
    sampler = Sampler(500, seed=0)
    for _ in range(3):
        assert sampler(logits, requests).token_ids == logits.argmax(-1).tolist()


# Random sampling: support and frequencies.


def test_min_p_keeps_only_tokens_above_min_p_times_the_best() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.04, 0.01])
    logits = probs.log().expand(3000, -1)
    requests = [make_request(f"r{i}", SamplingParams(min_p=0.3)) for i in range(3000)]
    tokens = Sampler(6, seed=0)(logits, requests).token_ids
    # 0.3 * 0.4 = 0.12: tokens 0, 1 and 2 stay, and with 3000 draws each shows up.
    assert set(tokens) == {0, 1, 2}


def test_min_p_is_relative_to_each_rows_own_best_token() -> None:
    """In a batch of peaked rows (best 0.9) and flat rows (best 0.4), min-p 0.5 keeps only the best
    token of a peaked row but all three of a flat row: the threshold is not the batch's best."""
    peaked, flat = torch.tensor([0.9, 0.05, 0.05]).log(), torch.tensor([0.4, 0.35, 0.25]).log()
    logits = torch.stack([peaked, flat] * 300)
    requests = [make_request(f"r{i}", SamplingParams(min_p=0.5)) for i in range(600)]
    tokens = Sampler(3, seed=0)(logits, requests).token_ids
    assert set(tokens[0::2]) == {0}
    assert set(tokens[1::2]) == {0, 1, 2}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.7, 0, 1.0, 0.0), (1.3, 0, 1.0, 0.0), (1.0, 4, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 5, 0.9, 0.1)],
)
def test_sampling_frequencies_match_the_filtered_softmax(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    requests = [make_request(f"r{i}", params) for i in range(20000)]
    tokens = Sampler(8, seed=1234)(row.expand(20000, -1), requests).token_ids
    expected = reference_filter(row / temperature, top_k, top_p, min_p).softmax(-1)
    # 7 degrees of freedom at most: 40 is far in the tail (p < 1e-5); the seed is fixed anyway.
    assert chi_square(Counter(tokens), expected) < 40


def test_filters_match_a_full_sort_reference_whatever_the_prefix_width() -> None:
    generator = torch.Generator().manual_seed(5)
    for trial in range(200):
        rows, vocab_size = trial % 5 + 1, trial % 37 + 2
        logits = torch.randn(rows, vocab_size, generator=generator) * (trial % 4 + 0.5)
        top_k = torch.randint(-1, vocab_size + 2, (rows,), generator=generator).tolist()
        top_p = [p if p < 0.9 else 1.0 for p in (torch.rand(rows, generator=generator) + 0.01).tolist()]
        for width in (1, 3, vocab_size):
            cutoffs = top_k_top_p_cutoffs(logits, top_k, top_p, width=width)
            for row in range(rows):
                expected = reference_filter(logits[row], top_k[row], top_p[row], 0.0).isfinite()
                assert torch.equal(logits[row] >= cutoffs[row], expected), (trial, width, row)


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, [0]), (0.75, [0, 1])])
def test_top_p_drops_a_token_whose_higher_ranked_mass_is_exactly_top_p(top_p: float, kept: list[int]) -> None:
    """Probabilities 1/2, 1/4, 1/8, 1/8 (exact in float32): with top_p 0.5 the second token has exactly
    0.5 ranked above it, so it goes (vLLM keeps a token while that mass is strictly below top_p)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 1.0]]) * math.log(2)
    cutoffs = top_k_top_p_cutoffs(logits, [0], [top_p])
    assert (logits[0] >= cutoffs[0]).nonzero().squeeze(1).tolist() == kept
    assert torch.equal(logits[0] >= cutoffs[0], reference_filter(logits[0], 0, top_p, 0.0).isfinite())


def test_top_p_wider_than_the_ranked_prefix_keeps_the_right_tokens() -> None:
    """Two tiers of tokens, the higher one (even ids, 73% of the mass) wider than the prefix that
    top-p ranks first: that prefix holds too little mass to decide, the full ranking keeps the tier."""
    vocab_size = 3 * TOP_P_PREFIX
    logits = (torch.arange(vocab_size) % 2 == 0).float().unsqueeze(0)
    for top_k in (0, -1):
        cutoffs = top_k_top_p_cutoffs(logits, [top_k], [0.6])
        assert torch.equal(logits[0] >= cutoffs[0], logits[0] == 1)


def test_top_p_just_below_one_when_the_ranked_mass_rounds_below_it() -> None:
    """With logits 0..19, the float32 probabilities sum to 1 - 3e-7, under top_p = 1 - 1e-7: the whole
    row is ranked and still short of top_p, which must keep (almost) everything, not fail."""
    logits = torch.arange(20, dtype=torch.float32).unsqueeze(0)
    params = SamplingParams(top_p=1 - 1e-7)
    cutoffs = top_k_top_p_cutoffs(logits, [0], [params.top_p])
    assert torch.all((logits[0] >= cutoffs[0]) >= reference_filter(logits[0], 0, params.top_p, 0.0).isfinite())
    assert 0 <= Sampler(20, seed=0)(logits, [make_request("r", params)]).token_ids[0] < 20


@pytest.mark.parametrize("top_k", [0, -1, 6])
def test_rows_that_ask_for_no_filter_keep_every_token(top_k: int) -> None:
    logits = random_logits(2, 6, seed=8)
    assert top_k_top_p_cutoffs(logits, [top_k, top_k], [1.0, 1.0]).tolist() == [[float("-inf")]] * 2


# Seeds.


def run_steps(sampler: Sampler, batch: list[Request], steps: int) -> dict[str, list[int]]:
    """Samples `steps` tokens for every request; step s uses the same logits in every run."""
    for step in range(steps):
        logits = random_logits(1, 200, seed=100 + step, scale=1.0).expand(len(batch), -1)
        for request, token in zip(batch, sampler(logits, batch).token_ids, strict=True):
            request.append_output_token(token)
    return {request.request_id: request.output_token_ids for request in batch}


def seeded_batch(layout: str) -> list[Request]:
    """`a` and `b` are seeded; `x` rows draw from the shared generator."""
    params = {"a": SamplingParams(seed=7, top_p=0.95), "b": SamplingParams(seed=8, repetition_penalty=1.2)}
    return [make_request(name, params.get(name[0], SamplingParams())) for name in layout.split()]


def test_same_seed_gives_same_tokens_whatever_the_batch() -> None:
    alone = run_steps(Sampler(200), seeded_batch("a"), steps=6)
    crowded = run_steps(Sampler(200), seeded_batch("x1 x2 a x3 b"), steps=6)
    reordered = run_steps(Sampler(200), seeded_batch("b x1 a"), steps=6)
    assert alone["a"] == crowded["a"] == reordered["a"]
    assert crowded["b"] == reordered["b"]


def test_a_sampler_seed_reproduces_unseeded_rows_whatever_seeded_rows_share_the_batch() -> None:
    """Sampler(seed=...) gives unseeded rows one shared stream, taken row by row in batch order;
    seeded rows draw from their own generators and take nothing from it."""
    alone = run_steps(Sampler(200, seed=11), seeded_batch("x1 x2"), steps=6)
    crowded = run_steps(Sampler(200, seed=11), seeded_batch("a x1 b x2"), steps=6)
    assert alone["x1"] == crowded["x1"] and alone["x2"] == crowded["x2"]
    # The shared seed decides the tokens, not chance or torch's global generator.
    assert run_steps(Sampler(200, seed=12), seeded_batch("x1 x2"), steps=6) != alone


def test_different_seeds_give_different_tokens() -> None:
    batch = [make_request("a", SamplingParams(seed=1)), make_request("b", SamplingParams(seed=2))]
    outputs = run_steps(Sampler(200), batch, steps=8)
    assert outputs["a"] != outputs["b"]


def test_free_drops_the_generator_and_a_new_request_starts_afresh() -> None:
    sampler = Sampler(200)
    first = run_steps(sampler, [make_request("a", SamplingParams(seed=3))], steps=4)["a"]
    # Without free, a request with the same id would continue the old stream.
    continued = run_steps(sampler, [make_request("a", SamplingParams(seed=3))], steps=4)["a"]
    sampler.free("a")
    sampler.free("never-seen")
    restarted = run_steps(sampler, [make_request("a", SamplingParams(seed=3))], steps=4)["a"]
    assert restarted == first
    assert continued != first


# Logits processing.


def expected_penalized(logits: list[float], request: Request) -> list[float]:
    """The penalty formulas, token by token."""
    params = request.sampling_params
    counts = Counter(request.output_token_ids)
    result = []
    for token, logit in enumerate(logits):
        if token in request.all_token_ids:
            p = params.repetition_penalty
            logit = logit / p if logit > 0 else logit * p
        logit -= params.presence_penalty * (counts[token] > 0) + params.frequency_penalty * counts[token]
        result.append(logit)
    return result


def test_penalties_follow_the_formulas() -> None:
    logits = torch.tensor([[1.5, -0.5, 2.0, 0.8, -1.2, 0.3, -2.0, 0.0]] * 3)
    all_three = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    requests = [
        make_request("all", all_three, prompt=[1, 2], outputs=[2, 3, 3, 5, 3]),
        make_request("repetition", SamplingParams(repetition_penalty=0.8), prompt=[4, 0], outputs=[6]),
        make_request("frequency", SamplingParams(frequency_penalty=-1.0), prompt=[7], outputs=[1, 1]),
    ]
    penalized = logits.clone()
    apply_penalties(penalized, requests)
    for row, request in enumerate(requests):
        assert penalized[row].tolist() == pytest.approx(expected_penalized(logits[row].tolist(), request))


def test_penalties_apply_only_to_rows_that_ask_and_before_greedy_argmax() -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.5]] * 2)
    penalized = make_request("p", SamplingParams(temperature=0, frequency_penalty=1.0), outputs=[2])
    plain = make_request("q", SamplingParams(temperature=0), outputs=[2])
    processed = process_logits(logits, [penalized, plain])
    assert processed[0].tolist() == [0.0, 1.0, 2.0, 2.5]
    assert torch.equal(processed[1], logits[1])
    assert Sampler(4)(logits, [penalized, plain]).token_ids == [3, 2]


def test_penalties_on_bfloat16_logits_are_applied_in_float32() -> None:
    """Processing works on a float32 copy: a penalty of 0.005 on a bfloat16 logit 1.0078125 leaves
    1.0028 (still the best), where bfloat16 arithmetic would round it to 1.0, a tie the argmax
    gives to token 0."""
    logits = torch.tensor([[1.0, 1.0078125]], dtype=torch.bfloat16)
    request = make_request("p", SamplingParams(temperature=0, presence_penalty=0.005), outputs=[1])
    assert process_logits(logits, [request]).dtype == torch.float32
    assert Sampler(2)(logits, [request]).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    # EOS (0) is best, then stop id 5, then 7.
    logits = torch.tensor([[9.0, 1.0, 0.0, 0.0, 0.0, 8.0, 0.0, 7.0]])
    for params in (
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(5,)),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(5,), ignore_eos=True),
    ):
        request = make_request("r", params)
        sampler = Sampler(8)
        for expected in (7, 7, 0):
            token = sampler(logits, [request]).token_ids[0]
            assert token == expected
            request.append_output_token(token)


def test_min_tokens_masks_random_rows_too() -> None:
    logits = torch.tensor([[10.0, 0.0, 10.0, 0.0]]).expand(500, -1)
    params = SamplingParams(min_tokens=1, stop_token_ids=(2,))
    requests = [make_request(f"r{i}", params) for i in range(500)]
    assert set(Sampler(4, seed=0)(logits, requests).token_ids) == {1, 3}


def test_the_callers_logits_are_left_untouched() -> None:
    logits = random_logits(3, 20, seed=6)
    before = logits.clone()
    params = SamplingParams(min_tokens=3, repetition_penalty=2.0, top_k=5, top_p=0.5, min_p=0.1)
    greedy = SamplingParams(temperature=0, presence_penalty=1.0)
    requests = [make_request("a", params, outputs=[4]), make_request("b", greedy, outputs=[4]),
                make_request("c", SamplingParams())]
    Sampler(20, seed=0)(logits, requests)
    assert torch.equal(logits, before)


# Logprobs.


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = random_logits(3, 40, seed=7)
    processed = SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=4)
    requests = [
        make_request("four", processed, prompt=list(range(20))),
        make_request("zero", SamplingParams(temperature=0, logprobs=0)),
        make_request("none", SamplingParams(temperature=0)),
    ]
    output = Sampler(40, seed=0)(logits, requests)
    raw = torch.log_softmax(logits, dim=-1)
    for row, count in ((0, 4), (1, 0)):
        entry = output.logprobs[row]
        assert entry is not None
        assert entry.token_id == output.token_ids[row]
        assert entry.logprob == pytest.approx(float(raw[row, entry.token_id]), abs=1e-6)
        values, ids = raw[row].topk(count)
        assert [token for token, _ in entry.top] == ids.tolist()
        assert [value for _, value in entry.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert [value for _, value in entry.top] == sorted((value for _, value in entry.top), reverse=True)
    assert output.logprobs[2] is None


def test_wrong_shapes_are_refused() -> None:
    requests = [make_request("r", SamplingParams())]
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(10)(torch.zeros(2, 10), requests)
    with pytest.raises(ValueError, match="columns"):
        Sampler(10)(torch.zeros(1, 9), requests)


# Any parameters.

params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.just(8),
    temperature=st.sampled_from([0.0, 1e-6, 0.3, 1.0, 2.0]),
    top_p=st.sampled_from([1.0, 0.9, 0.5, 1e-3]),
    top_k=st.integers(-1, 12),
    min_p=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    repetition_penalty=st.sampled_from([1.0, 0.5, 1.3]),
    presence_penalty=st.sampled_from([0.0, -2.0, 1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    seed=st.none() | st.integers(0, 3),
    stop_token_ids=st.lists(st.integers(0, 40), max_size=2),
    min_tokens=st.integers(0, 2),
    logprobs=st.none() | st.integers(0, 5),
)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(params_strategy, st.lists(st.integers(0, 15), max_size=4)), min_size=1, max_size=5),
    st.integers(6, 16),
    st.integers(0, 2**16),
)
def test_any_parameters_give_valid_tokens(
    rows: list[tuple[SamplingParams, list[int]]], vocab_size: int, seed: int
) -> None:
    requests = [make_request(f"r{i}", params, outputs=outputs) for i, (params, outputs) in enumerate(rows)]
    logits = random_logits(len(rows), vocab_size, seed=seed)
    output = Sampler(vocab_size)(logits, requests)
    greedy_choice = process_logits(logits, requests).argmax(-1).tolist()
    for row, (request, token) in enumerate(zip(requests, output.token_ids, strict=True)):
        params = request.sampling_params
        assert 0 <= token < vocab_size
        if params.temperature < 1e-5:
            assert token == greedy_choice[row]
        if request.num_output_tokens < params.min_tokens:
            assert token != EOS and token not in params.stop_token_ids
        logprobs = output.logprobs[row]
        assert (logprobs is None) == (params.logprobs is None)
        if logprobs is not None:
            assert logprobs.token_id == token and len(logprobs.top) == params.logprobs


def test_temperature_applies_before_top_p() -> None:
    """vLLM's order: logits are tempered, then top-p keeps the smallest set of tokens reaching p. Raw
    probabilities of [2, 1, 0] are 0.67, 0.24, 0.09: top-p 0.7 before tempering keeps two tokens;
    after temperature 0.5 (0.87, 0.12, 0.02) only the first."""
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    sampler = Sampler(3, seed=0)
    drawn = Counter(sampler(logits, [make_request(f"r{i}", SamplingParams(temperature=0.5, top_p=0.7))]).token_ids[0]
                    for i in range(300))
    assert drawn == Counter({0: 300})


def test_temperature_applies_before_min_p() -> None:
    """min-p is relative to the most likely token after tempering: with temperature 2 the second token
    (probability ratio e^-0.5 = 0.61 to the first) passes min-p 0.5; untempered (0.37) it would not."""
    logits = torch.tensor([[1.0, 0.0, -9.0]])
    sampler = Sampler(3, seed=0)
    drawn = Counter(sampler(logits, [make_request(f"r{i}", SamplingParams(temperature=2.0, min_p=0.5))]).token_ids[0]
                    for i in range(300))
    assert set(drawn) == {0, 1}


@pytest.mark.parametrize("params", [SamplingParams(repetition_penalty=1.5), SamplingParams(repetition_penalty=0.7),
                                    SamplingParams(repetition_penalty=2.0), SamplingParams(presence_penalty=1.0),
                                    SamplingParams(presence_penalty=0.5), SamplingParams(frequency_penalty=0.25),
                                    SamplingParams(presence_penalty=-0.5, frequency_penalty=0.5)])
def test_each_penalty_applies_when_it_is_the_batchs_only_one(params: SamplingParams) -> None:
    """A batch whose every row asks for one penalty (and none for the others) still gets it."""
    logits = torch.tensor([[1.5, -0.5, 2.0, 0.8, -1.2, 0.3, -2.0, 0.0]])
    request = make_request("only", params, prompt=[1, 2, 6], outputs=[2, 3, 3, 4])
    penalized = logits.clone()
    apply_penalties(penalized, [request])
    assert penalized[0].tolist() == pytest.approx(expected_penalized(logits[0].tolist(), request))
    assert not torch.equal(penalized, logits)


def test_min_tokens_skips_stop_ids_past_the_vocabulary() -> None:
    """A stop id equal to the vocabulary size names no column: EOS is masked, nothing is out of range."""
    logits = torch.tensor([[9.0, 1.0, 0.0, 3.0]])
    request = make_request("r", SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(4, 99)))
    assert Sampler(4)(logits, [request]).token_ids == [3]


def test_a_seeded_request_continues_its_draws_on_another_sampler() -> None:
    """A decode worker (a new sampler) after the prefill's tokens, or a run resumed after
    `seed_offset` tokens, draws what one sampler would have drawn next."""
    logits = random_logits(1, 40, seed=7, scale=0.5)  # flat: every draw matters
    params = SamplingParams(temperature=1.0, seed=1234)
    one = make_request("one", params)
    sampler = Sampler(40)
    for _ in range(5):
        one.append_output_token(sampler(logits, [one]).token_ids[0])
    after_outputs = make_request("split", params, outputs=one.output_token_ids[:3])
    assert [Sampler(40)(logits, [after_outputs]).token_ids[0]] == one.output_token_ids[3:4]
    resumed = make_request("resumed", SamplingParams(temperature=1.0, seed=1234, seed_offset=2),
                           outputs=one.output_token_ids[2:4])  # 2 drawn elsewhere, 2 here before
    assert [Sampler(40)(logits, [resumed]).token_ids[0]] == one.output_token_ids[4:5]


# Structured outputs: grammar masks on some rows of a batch.


@pytest.fixture(scope="module")
def grammars(tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))
    return GrammarCompiler.from_tokenizer(tokenizer)


DIGITS = StructuredOutput("regex", "[0-9]{1,40}")
MIXED_BATCH = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=5),
               SamplingParams(temperature=1.0, top_k=20, top_p=0.9), SamplingParams(temperature=0, min_tokens=3),
               SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5),
               SamplingParams(temperature=0.8, min_p=0.05), SamplingParams(temperature=0, frequency_penalty=1.0)]


def mixed_batch(grammars: GrammarCompiler, constrained: set[int]) -> list[Request]:
    requests = [make_request(f"r{row}", params, outputs=[7, 9]) for row, params in enumerate(MIXED_BATCH)]
    for row in constrained:
        requests[row].grammar = grammars.matcher(DIGITS)
    return requests


def digit_tokens(grammars: GrammarCompiler) -> set[int]:
    return {token for token in range(grammars.vocab_size) if grammars.matcher(DIGITS).accept(token)}


def test_constrained_rows_sample_only_what_their_grammar_allows(grammars: GrammarCompiler) -> None:
    allowed = digit_tokens(grammars)
    assert 0 < len(allowed) < grammars.vocab_size / 4
    sampler = Sampler(grammars.vocab_size, seed=0)
    for step in range(20):
        requests = mixed_batch(grammars, constrained={0, 1, 2, 3, 4, 5, 6, 7})
        tokens = sampler(random_logits(len(requests), grammars.vocab_size, seed=step), requests).token_ids
        assert set(tokens) <= allowed, step


def test_unconstrained_rows_sample_as_in_a_batch_without_grammars(grammars: GrammarCompiler) -> None:
    """Half the rows constrained: the other half draws exactly the tokens it draws when no row is
    (greedy, seeded and unseeded rows alike), while the constrained half does change."""
    plain, mixed = Sampler(grammars.vocab_size, seed=3), Sampler(grammars.vocab_size, seed=3)
    constrained = {1, 2, 4, 7}
    changed = 0
    for step in range(10):
        logits = random_logits(len(MIXED_BATCH), grammars.vocab_size, seed=100 + step)
        free = plain(logits, mixed_batch(grammars, set())).token_ids
        masked = mixed(logits, mixed_batch(grammars, constrained)).token_ids
        assert [masked[row] for row in range(len(free)) if row not in constrained] == \
            [free[row] for row in range(len(free)) if row not in constrained]
        changed += sum(masked[row] != free[row] for row in constrained)
    assert changed > 0  # the masks did bite


def test_masks_computed_ahead_equal_those_the_sampler_computes(grammars: GrammarCompiler) -> None:
    logits = random_logits(len(MIXED_BATCH), grammars.vocab_size, seed=9)
    ahead = GrammarMasker(overlap=True).start(mixed_batch(grammars, {0, 3, 5}))
    assert ahead is not None
    masks = ahead.result()
    assert masks is not None and masks.rows == [0, 3, 5]
    given = Sampler(grammars.vocab_size, seed=4)(logits, mixed_batch(grammars, {0, 3, 5}), masks).token_ids
    computed = Sampler(grammars.vocab_size, seed=4)(logits, mixed_batch(grammars, {0, 3, 5})).token_ids
    assert given == computed
    assert GrammarMasker().start(mixed_batch(grammars, set())) is None  # nothing to do without a grammar


def test_masks_for_other_rows_than_the_constrained_ones_are_refused(grammars: GrammarCompiler) -> None:
    requests = mixed_batch(grammars, {1})
    masks = GrammarMasker(overlap=False).start(mixed_batch(grammars, {2}))
    assert masks is not None
    with pytest.raises(ValueError, match="grammar masks for rows"):
        Sampler(grammars.vocab_size)(random_logits(len(requests), grammars.vocab_size, seed=0), requests,
                                     masks.result())


def test_logit_bias_adds_to_its_rows_tokens_before_greedy_and_random_sampling() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [0.0, 5.0, 1.0, 2.0], [0.0, 5.0, 1.0, 2.0]])
    favoured = make_request("favoured", SamplingParams(temperature=0, logit_bias=((2, 100.0),)))
    banned = make_request("banned", SamplingParams(temperature=1.0, seed=3, logit_bias=((1, -100.0), (3, 10.0))))
    plain = make_request("plain", SamplingParams(temperature=0))
    output = Sampler(4)(logits, [favoured, banned, plain])
    assert output.token_ids == [2, 3, 1]
    assert logits[0, 2] == 1.0  # the caller's logits are untouched


def test_logit_bias_is_refused_out_of_range() -> None:
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias=((1, 101.0),))
    with pytest.raises(ValueError, match="non-negative"):
        SamplingParams(logit_bias=((-1, 1.0),))
