"""The planner picks the optimum worked out by hand on straight-line profiles (tests/planner/profiles.py:
a prompt of 1000 tokens takes 1.01 s to prefill, a decode step of b rows 0.01 + 0.001 b s, KV 1 us a token)."""

from __future__ import annotations

import pytest

from cluster.planner.plan import SearchSpace, Slo, plan
from cluster.planner.simulator import COLOCATED, DISAGGREGATED
from cluster.planner.workload import Lengths, WorkloadSpec
from tests.planner.profiles import linear_profile

PROFILE = linear_profile(transfer_per_token_s=1e-6)


def requests(interval_s: float, count: int, output_tokens: int):  # noqa: ANN201
    return WorkloadSpec("constant", rate=1 / interval_s, num_requests=count, prompt=Lengths(value=1000),
                        output=Lengths(value=output_tokens)).requests()


def shape(candidate) -> tuple[str, int, int]:  # noqa: ANN001
    topology = candidate.topology
    return topology.mode, topology.num_prefill if topology.mode == DISAGGREGATED else 0, topology.num_decode


def test_short_answers_colocated_wins_on_goodput_per_worker():
    # A request every 0.8 s needs 1.01 s of prefill and 10 decode steps (0.11 s): one worker, or one
    # prefill worker, falls behind and TTFTs grow past 1.5 s. Two colocated workers take every other
    # request, each done before its worker's next: all meet the SLOs at 2 workers, where a
    # disaggregated cluster that keeps up needs 2 prefill workers and a decode worker (3).
    result = plan(PROFILE, requests(0.8, 20, 11), Slo(1.5, 0.05), SearchSpace(3, (2048,), (256,)))
    assert shape(result.best) == (COLOCATED, 0, 2)
    assert result.best.attainment == 1.0
    assert result.best.goodput_per_worker == pytest.approx(result.best.goodput / 2)
    assert shape(result.runner_up) in {(COLOCATED, 0, 3), (DISAGGREGATED, 2, 1)}
    assert result.meets_slo


def test_prefill_bound_long_answers_with_tight_tpot_get_two_prefill_workers_and_one_decode():
    # A request every 0.6 s, 100 decode steps each (about 1.1 s): answers overlap. In a colocated
    # worker the next request's 1 s prefill lands in a running answer's steps and pushes its TPOT to
    # about 0.021 s, past the 15 ms SLO, unless 4 workers keep requests apart. Disaggregated, one
    # prefill worker (1.01 s per 0.6 s) falls behind; two keep up, and one decode worker runs the
    # few overlapping answers at 0.012 s a step. So 2P+1D: 3 workers, where colocated needs 4.
    result = plan(PROFILE, requests(0.6, 30, 101), Slo(1.5, 0.015), SearchSpace(4, (2048,), (256,)))
    assert shape(result.best) == (DISAGGREGATED, 2, 1)
    assert result.best.attainment == 1.0
    by_shape = {shape(c): c for c in reversed(result.ranked)}
    assert by_shape[(COLOCATED, 0, 3)].attainment < 0.9
    assert by_shape[(DISAGGREGATED, 1, 2)].attainment < 0.9


def test_slow_transfer_turns_the_choice_to_colocated():
    # The same workload with KV taking 0.1 ms a token: 0.1 s more before every answer's second token
    # adds 1 ms to its TPOT (0.012 + 0.001 ~ 0.013 s, still in the SLO); at 0.5 ms a token (+5 ms)
    # every disaggregated TPOT misses 15 ms and only 4 colocated workers meet it.
    slow = linear_profile(transfer_per_token_s=5e-4)
    result = plan(slow, requests(0.6, 30, 101), Slo(1.5, 0.015), SearchSpace(4, (2048,), (256,)))
    assert shape(result.best) == (COLOCATED, 0, 4)


def test_no_configuration_meets_the_slo_says_so_and_ranks_by_attainment():
    result = plan(PROFILE, requests(0.1, 20, 11), Slo(1.5, 0.05), SearchSpace(2, (2048,), (256,)))
    assert not result.meets_slo
    attainments = [candidate.attainment for candidate in result.ranked]
    assert attainments == sorted(attainments, reverse=True)


def test_search_space_counts_every_split_and_limit():
    space = SearchSpace(3, (256, 512), (16,))
    # Colocated: 3 sizes x 2 limits; disaggregated: splits of 2 (1) and 3 workers (2) x 2 limits.
    assert sum(1 for _ in space.topologies()) == 3 * 2 + 3 * 2
    assert sum(1 for _ in SearchSpace(3, (256, 512), (16,), per_pool=True).topologies()) == 3 * 2 + 3 * 4


def test_bad_slo_and_budget_are_refused_by_name():
    with pytest.raises(ValueError, match="budget"):
        SearchSpace(0)
    with pytest.raises(ValueError, match="SLOs"):
        Slo(0, 0.1)


def test_a_cheaper_shape_that_misses_the_attainment_is_not_chosen():
    # One colocated worker, a request every 0.8 s: each prompt (1 s) joins the running answer's steps
    # at once, so the five TTFTs are 1.01 s, then about 0.21 s more each (1.22, 1.43, 1.65, 1.86): under
    # a 1.75 s SLO 4 of 5 (80%) meet it, 4 requests over 5.2 s, 0.77/s for its one worker. Two workers
    # take turns and all 5 meet it (over 4.32 s: 0.58/s a worker), the only shape to reach 90%.
    specs = requests(0.8, 5, 11)
    space = SearchSpace(2, (2048,), (256,), modes=(COLOCATED,))
    strict = plan(PROFILE, specs, Slo(1.75, 1.0, attainment=0.9), space)
    assert shape(strict.best) == (COLOCATED, 0, 2)
    lenient = plan(PROFILE, specs, Slo(1.75, 1.0, attainment=0.8), space)
    assert shape(lenient.best) == (COLOCATED, 0, 1)
    assert lenient.best.attainment == pytest.approx(0.8)


def test_limits_that_change_nothing_are_left_at_the_engine_defaults():
    # One request of 1000 tokens and 11 outputs, alone: 1000 tokens fit in a step of the default
    # 2048 (and take two steps at 512, no later than one at 1024), no batch limit binds. Every limit
    # but the 512 budget ties on goodput per worker: the plan keeps the engine's 2048 and 256.
    result = plan(PROFILE, requests(1.0, 1, 11), Slo(5.0, 0.05), SearchSpace(1, (1024, 2048, 512), (16, 256)))
    limits = result.best.topology.decode_limits
    assert (limits.max_num_batched_tokens, limits.max_num_seqs) == (2048, 256)
