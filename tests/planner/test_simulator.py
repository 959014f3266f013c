"""The simulator against cases worked out by hand on straight-line profiles (tests/planner/profiles.py):
prefill(t) = 0.01 + 0.001 t, decode(b) = 0.01 + 0.001 b, a mixed step their sum less one 0.01."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.planner.front_door import CpuWindow, front_door_costs
from cluster.planner.profile import Serving
from cluster.planner.simulator import (
    COLOCATED,
    DISAGGREGATED,
    PoolLimits,
    Topology,
    front_door_cores,
    oversubscription,
    percentile,
    serving_from_lone_requests,
    simulate,
)
from cluster.planner.workload import RequestSpec
from tests.planner.profiles import linear_profile


def test_one_request_disaggregated_first_token_at_prefill_end_then_transfer_then_decode_steps():
    profile = linear_profile(transfer_per_token_s=0.0001)
    result = simulate(profile, Topology(DISAGGREGATED, 1, 1, kv_overlap=False), [RequestSpec(0.5, 200, 4)])
    (request,) = result.requests
    prefill, transfer, decode = 0.01 + 0.2, 200 * 0.0001, 0.01 + 0.001
    # The prefill worker streams token 1; the decode worker's first step (after the KV lands) gives token 2.
    assert request.ttft_s == pytest.approx(prefill)
    assert request.itls_s == pytest.approx([transfer + decode, decode, decode])
    assert request.tpot_s == pytest.approx((transfer + 3 * decode) / 3)


def test_overlapped_transfer_sends_only_the_last_chunk_after_the_prompt():
    profile = linear_profile(transfer_per_token_s=0.0001)
    limits = PoolLimits(max_num_batched_tokens=128)
    topology = Topology(DISAGGREGATED, 1, 1, prefill_limits=limits, decode_limits=limits, kv_overlap=True)
    (request,) = simulate(profile, topology, [RequestSpec(0.0, 300, 2)]).requests
    # Chunks of 128, 128 and 44 tokens under the token budget, one step each.
    assert request.ttft_s == pytest.approx(3 * 0.01 + 0.3)
    assert request.itls_s == pytest.approx([44 * 0.0001 + 0.011])


def test_colocated_constant_rate_queue_waits_grow_by_the_service_excess():
    # One worker, one request at a time; each request is a 90-token prompt and one token: 0.1 s of
    # service, arriving every 0.08 s. Request i waits i * (0.1 - 0.08) s before its own 0.1 s.
    profile = linear_profile()
    topology = Topology(COLOCATED, 0, 1, decode_limits=PoolLimits(max_num_seqs=1))
    specs = [RequestSpec(i * 0.08, 90, 1) for i in range(5)]
    result = simulate(profile, topology, specs)
    assert [r.ttft_s for r in result.requests] == pytest.approx([0.1 + i * 0.02 for i in range(5)])
    assert result.duration_s == pytest.approx(0.5)


def test_token_budget_chunks_the_second_prompt_behind_the_first_ones_decode():
    # Budget 100: step 1 is A's whole prompt (0.11 s, token 1 of A); step 2 is A's decode row and 99
    # tokens of B (0.011 + 0.109 - 0.01 = 0.11); step 3 is A's row and B's last token (0.011 + 0.011 - 0.01).
    profile = linear_profile()
    topology = Topology(COLOCATED, 0, 1, decode_limits=PoolLimits(max_num_batched_tokens=100))
    a, b = simulate(profile, topology, [RequestSpec(0.0, 100, 3), RequestSpec(0.0, 100, 1)]).requests
    assert b.ttft_s == pytest.approx(0.11 + 0.11 + 0.012)
    assert a.token_times == pytest.approx((0.11, 0.22, 0.232))


def test_router_spreads_by_requests_in_flight_and_prefill_by_queued_tokens():
    profile = linear_profile()
    specs = [RequestSpec(0.0, 1000, 2), RequestSpec(0.0, 10, 2), RequestSpec(0.0, 10, 2)]
    result = simulate(profile, Topology(DISAGGREGATED, 2, 1), specs)
    # Prefill worker 0 takes the long prompt; both short ones go to worker 1 (10 < 1000 queued tokens).
    # An idle worker starts a step the moment a request comes, so the second short one runs next.
    long, short1, short2 = result.requests
    assert long.ttft_s == pytest.approx(1.01)
    assert (short1.ttft_s, short2.ttft_s) == pytest.approx((0.02, 0.04))


def test_percentile_is_numpys_linear():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)


def test_max_num_seqs_keeps_the_second_request_waiting_until_the_first_ends():
    # One running request at a time: A's prompt (0.11 s) and two decode steps (0.011 s each), then B's prompt.
    topology = Topology(COLOCATED, 0, 1, decode_limits=PoolLimits(max_num_seqs=1))
    a, b = simulate(linear_profile(), topology, [RequestSpec(0.0, 100, 3), RequestSpec(0.0, 100, 3)]).requests
    assert a.token_times == pytest.approx((0.11, 0.121, 0.132))
    assert b.ttft_s == pytest.approx(0.132 + 0.11)


def test_serving_latencies_delay_the_first_token_and_lengthen_every_step_of_their_mode_only():
    # Disaggregated: 50 ms of hops before the prompt's step, each step 2 ms longer than the engine's;
    # the colocated figures (a second apart) must not be used.
    profile = replace(linear_profile(transfer_per_token_s=0.0001),
                      serving={DISAGGREGATED: Serving(first_token_s=0.05, step_s=0.002),
                               COLOCATED: Serving(first_token_s=1.0, step_s=1.0)})
    topology = Topology(DISAGGREGATED, 1, 1, kv_overlap=False)
    (request,) = simulate(profile, topology, [RequestSpec(0.5, 200, 3)]).requests
    prefill, transfer, decode = 0.01 + 0.2 + 0.002, 200 * 0.0001, 0.01 + 0.001 + 0.002
    assert request.ttft_s == pytest.approx(0.05 + prefill)
    assert request.itls_s == pytest.approx([transfer + decode, decode])


def test_workers_whose_threads_outnumber_the_cores_step_slower_by_the_oversubscription():
    # Two requests of a 100-token prompt and one token, at once, on two colocated workers: one step
    # each, 0.11 s profiled. Two 2-thread workers on 2 cores: 4 threads for 2 cores, steps 2x.
    profile = replace(linear_profile(), threads=2, machine={"cores": 2})
    specs = [RequestSpec(0.0, 100, 1), RequestSpec(0.0, 100, 1)]
    shared = simulate(profile, Topology(COLOCATED, 0, 2), specs)
    assert [r.ttft_s for r in shared.requests] == pytest.approx([0.22, 0.22])
    assert oversubscription(profile, Topology(COLOCATED, 0, 2)) == 2.0
    # One such worker, or two 1-thread ones, or the same two on a 4-core machine: they fit.
    assert oversubscription(profile, Topology(COLOCATED, 0, 1)) == 1.0
    assert oversubscription(replace(profile, threads=1), Topology(COLOCATED, 0, 2)) == 1.0
    assert oversubscription(profile, Topology(COLOCATED, 0, 2, cores=4)) == 1.0
    # 1P+2D of 2-thread workers on 4 cores: 6 threads for 4 cores.
    assert oversubscription(profile, Topology(DISAGGREGATED, 1, 2, cores=4)) == 1.5
    assert [r.ttft_s for r in simulate(profile, Topology(COLOCATED, 0, 2, cores=4), specs).requests] \
        == pytest.approx([0.11, 0.11])


@pytest.mark.parametrize("threads, workers, ttft, gap, first_token, step",
                         [(1, 1, 0.1, 0.015, 0.054, 0.004),  # 0.1 - (0.042 + 0.004); 0.015 - 0.011
                          (2, 2, 0.2, 0.03, 0.108, 0.004)])  # slowdown 2: 0.2 - 2 x 0.046; 0.03 / 2 - 0.011
def test_serving_latencies_from_lone_requests_make_the_simulator_reproduce_them(threads, workers, ttft, gap,
                                                                                first_token, step):
    # A 32-token prompt: prefill 0.01 + 0.032 s; one decode row 0.011 s. On 2 cores.
    profile = replace(linear_profile(), threads=threads, machine={"cores": 2})
    topology = Topology(COLOCATED, 0, workers)
    serving = serving_from_lone_requests(profile, topology, 32, ttft_s=ttft, token_gap_s=gap)
    assert (serving.first_token_s, serving.step_s) == pytest.approx((first_token, step))
    (request,) = simulate(replace(profile, serving={COLOCATED: serving}), topology, [RequestSpec(1.0, 32, 4)]).requests
    assert request.ttft_s == pytest.approx(ttft)
    assert request.itls_s == pytest.approx([gap] * 3)
    # A cluster faster than the profile adds nothing (never a negative latency).
    assert serving_from_lone_requests(profile, topology, 32, ttft_s=0.01, token_gap_s=0.001) == Serving(0.0, 0.0)


def test_a_served_step_factor_lengthens_every_engine_step_of_its_mode_before_the_step_latency():
    # Colocated, factor 1.5 and 2 ms a step: the 100-token prompt's step 1.5 x 0.11 + 0.002 = 0.167 s,
    # each one-row decode step 1.5 x 0.011 + 0.002 = 0.0185 s. The disaggregated factor is not used.
    profile = replace(linear_profile(), serving={COLOCATED: Serving(step_s=0.002, step_factor=1.5),
                                                 DISAGGREGATED: Serving(step_factor=9.0)})
    (request,) = simulate(profile, Topology(COLOCATED, 0, 1), [RequestSpec(0.0, 100, 3)]).requests
    assert request.ttft_s == pytest.approx(0.167)
    assert request.itls_s == pytest.approx([0.0185, 0.0185])


def test_the_front_doors_cpu_on_shared_cores_slows_every_step_by_its_share():
    # Two 1-thread colocated workers on 2 cores, and a front door using 0.2 of a core idle, 0.05 CPU-s
    # a request and 0.01 a token. Two requests 2 s apart, 4 tokens each: 0.2 + (2 x 0.05 + 8 x 0.01) / 2
    # = 0.29 of a core, so 2.29 threads' worth of work on 2 cores: every step 1.145x.
    serving = Serving(front_door_idle_cores=0.2, front_door_request_cpu_s=0.05, front_door_token_cpu_s=0.01)
    profile = replace(linear_profile(), threads=1, machine={"cores": 2}, serving={COLOCATED: serving})
    specs = [RequestSpec(0.0, 100, 4), RequestSpec(2.0, 100, 4)]
    assert front_door_cores(serving, specs) == pytest.approx(0.29)
    first, _ = simulate(profile, Topology(COLOCATED, 0, 2), specs).requests
    assert first.ttft_s == pytest.approx(0.11 * 1.145)
    assert first.itls_s == pytest.approx([0.011 * 1.145] * 3)
    # One such worker leaves a core to the front door: no slowdown.
    alone, _ = simulate(profile, Topology(COLOCATED, 0, 1), specs).requests
    assert alone.ttft_s == pytest.approx(0.11)
    assert oversubscription(profile, Topology(COLOCATED, 0, 1), front_door=0.29) == 1.0
    assert oversubscription(profile, Topology(COLOCATED, 0, 2), front_door=0.29) == pytest.approx(1.145)


def test_a_long_lone_prompt_gives_the_served_step_factor_and_the_simulator_reproduces_all_three():
    # Lone requests: a 32-token prompt's TTFT 0.1 s, a 232-token one's 0.4 s, a token gap of 0.02 s.
    # Profile prefill 0.042 and 0.242 s: 0.3 s measured for 0.2 s profiled, factor 1.5 (the fixed
    # latencies cancel in the difference); step_s 0.02 - 1.5 x 0.011 = 0.0035; first token
    # 0.1 - (1.5 x 0.042 + 0.0035) = 0.0335.
    profile = linear_profile()
    topology = Topology(COLOCATED, 0, 1)
    serving = serving_from_lone_requests(profile, topology, 32, ttft_s=0.1, token_gap_s=0.02,
                                         long_prompt_tokens=232, long_ttft_s=0.4)
    assert (serving.step_factor, serving.step_s, serving.first_token_s) == pytest.approx((1.5, 0.0035, 0.0335))
    served = replace(profile, serving={COLOCATED: serving})
    short, long = simulate(served, topology, [RequestSpec(0.0, 32, 3), RequestSpec(10.0, 232, 1)]).requests
    assert (short.ttft_s, long.ttft_s) == pytest.approx((0.1, 0.4))
    assert short.itls_s == pytest.approx([0.02, 0.02])
    # A served worker is never faster than the engine alone: a smaller difference is noise, factor 1.
    assert serving_from_lone_requests(profile, topology, 32, ttft_s=0.1, token_gap_s=0.02, long_prompt_tokens=232,
                                      long_ttft_s=0.2).step_factor == 1.0


def test_front_door_costs_split_the_cpu_into_idle_per_request_and_per_token():
    # Idle: 0.2 CPU-s in 2 s, 0.1 of a core. Three one-token probes in 1 s: 0.4 CPU-s, 0.3 above idle,
    # 0.1 per request-with-one-token. The run: 10 s, 40 requests, 1,000 tokens, 6 CPU-s, 5 above idle:
    # 40 r + 1000 t = 5 and r + t = 0.1, so t = (5 - 4) / 960 and r = 0.1 - t.
    idle = CpuWindow(cpu_s=0.2, wall_s=2.0)
    costs = front_door_costs(idle, CpuWindow(0.4, 1.0, requests=3, tokens=3), CpuWindow(6.0, 10.0, 40, 1000))
    assert costs == pytest.approx((0.1, 0.1 - 1 / 960, 1 / 960))
    # Noise that would make a cost negative puts it all on the other: never below 0.
    assert front_door_costs(idle, CpuWindow(0.4, 1.0, 3, 3), CpuWindow(1.2, 10.0, 40, 1000)) == \
        pytest.approx((0.1, 0.2 / 40, 0.0))
    assert front_door_costs(idle, CpuWindow(0.103, 1.0, 3, 3), CpuWindow(6.0, 10.0, 40, 1000)) == \
        pytest.approx((0.1, 0.0, 5 / 1000))


def test_disaggregated_the_factor_is_the_prefill_workers_and_the_decode_worker_keeps_its_timed_gap():
    # The factor comes from prompts, which only the prefill worker runs: there each step is 1.5 x the
    # engine's + 2 ms (200-token prompt: 1.5 x 0.21 + 0.002 = 0.317 s); the decode worker's steps are
    # the engine's + 2 ms (0.011 + 0.002), its own gap timed alone.
    profile = replace(linear_profile(), serving={DISAGGREGATED: Serving(step_s=0.002, step_factor=1.5)})
    (request,) = simulate(profile, Topology(DISAGGREGATED, 1, 1, kv_overlap=False), [RequestSpec(0.0, 200, 3)]).requests
    assert request.ttft_s == pytest.approx(0.317)
    assert request.itls_s == pytest.approx([0.013, 0.013])
    # The inverse: lone TTFTs 0.1 and 0.4 s (factor 1.5), a gap of 0.02 s: step_s 0.02 - 0.011, unscaled.
    serving = serving_from_lone_requests(linear_profile(), Topology(DISAGGREGATED, 1, 1), 32, ttft_s=0.1,
                                         token_gap_s=0.02, long_prompt_tokens=232, long_ttft_s=0.4)
    assert (serving.step_factor, serving.step_s, serving.first_token_s) == \
        pytest.approx((1.5, 0.009, 0.1 - (1.5 * 0.042 + 0.009)))
