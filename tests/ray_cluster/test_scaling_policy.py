"""The live controller's decisions (no Ray): signals from worker loads, hysteresis, bounds, cooldown."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.common.loads import BucketCounts, WorkerLoad
from cluster.ray_cluster.config import PoolBounds, ScalingConfig, cluster_config_from
from cluster.ray_cluster.scaling_policy import (
    DECODE_TIME,
    DOWN,
    GENERATION_TOKENS,
    PREFILL_TIME,
    QUEUE_TIME,
    UP,
    PoolHysteresis,
    PoolSignals,
    pool_signals,
    quantile,
)

BOUNDS = (0.1, 0.5, 1.0, 2.0, 5.0)
CONFIG = ScalingConfig(enabled=True, decode=PoolBounds(1, 3), prefill=PoolBounds(1, 3), ttft_s=1.0, itl_s=0.1,
                       queue_depth=2.0, scale_down_below=0.3, sustain_s=5.0, cooldown_s=30.0)
BUSY = PoolSignals(workers=1, queue_depth=4.0)  # twice the queue target
CALM = PoolSignals(workers=1, queue_depth=1.0)  # under the target, over its low water
IDLE = PoolSignals(workers=2)


def load(worker_id: str, waiting: int = 0, started_at: float = 1.0, running: int = 0, held: int = 0,
         **histograms: list[int]) -> WorkerLoad:
    """A decode worker's load whose histograms count `histograms[name]` per bucket (names by keyword)."""
    names = {"queue": QUEUE_TIME, "prefill": PREFILL_TIME, "decode": DECODE_TIME, "tokens": GENERATION_TOKENS}
    counted = {}
    for key, counts in histograms.items():
        bucket = BucketCounts(BOUNDS)
        for index, count in enumerate(counts):
            for _ in range(count):
                bucket.observe(([*BOUNDS, 10.0])[index])
        counted[names[key]] = bucket
    return WorkerLoad(worker_id, "decode", running, waiting, 10, 10, 0.0, started_at=started_at, histograms=counted,
                      num_held=held)


def test_a_pool_over_its_target_grows_only_once_it_held_for_sustain_s() -> None:
    pool = PoolHysteresis("decode", CONFIG)
    assert pool.decide(BUSY, 100.0) is None
    assert pool.decide(BUSY, 104.9) is None
    decision = pool.decide(BUSY, 105.0)
    assert decision is not None and (decision.direction, decision.reason) == (UP, "queue_depth")
    assert "queue_depth 4 > 2" in decision.detail


def test_a_dip_under_the_target_starts_the_sustain_clock_again() -> None:
    pool = PoolHysteresis("decode", CONFIG)
    pool.decide(BUSY, 100.0)
    assert pool.decide(CALM, 103.0) is None
    assert pool.decide(BUSY, 104.0) is None
    assert pool.decide(BUSY, 108.9) is None  # 4.9 s since it went over again
    assert pool.decide(BUSY, 109.0) is not None


def test_no_decision_during_the_cooldown_after_one() -> None:
    pool = PoolHysteresis("decode", CONFIG)
    pool.decide(BUSY, 0.0)
    assert pool.decide(BUSY, 5.0) is not None
    grown = PoolSignals(workers=2, queue_depth=4.0)
    assert all(pool.decide(grown, now) is None for now in (6.0, 20.0, 34.9))
    decision = pool.decide(grown, 35.0)  # over since 6 s, cooldown over at 35 s
    assert decision is not None and decision.direction == UP


def test_an_operator_change_starts_the_cooldown_too() -> None:
    pool = PoolHysteresis("decode", CONFIG)
    pool.decide(BUSY, 0.0)
    pool.acted(4.0)
    assert pool.decide(BUSY, 5.0) is None
    assert pool.decide(BUSY, 33.9) is None


def test_an_idle_pool_shrinks_after_sustain_s_but_never_below_min_workers() -> None:
    pool = PoolHysteresis("decode", CONFIG)
    assert pool.decide(IDLE, 0.0) is None
    decision = pool.decide(IDLE, 5.0)
    assert decision is not None and (decision.direction, decision.reason) == (DOWN, "idle")
    at_min = PoolHysteresis("decode", CONFIG)
    assert all(at_min.decide(PoolSignals(workers=1), now) is None for now in (0.0, 10.0, 100.0))


def test_a_pool_whose_slots_are_busy_does_not_shrink_though_nothing_waits() -> None:
    """No queue is no idleness: one worker fewer must run what the pool holds within the low water
    of its slots (2 workers of 4 slots, low water 0.3: at most 1 request held in all)."""
    pool = PoolHysteresis("decode", CONFIG)
    busy = PoolSignals(workers=2, held=4, slots=8)  # nothing waits, half the slots run
    assert all(pool.decide(busy, now) is None for now in (0.0, 10.0, 100.0))
    quiet = PoolSignals(workers=2, held=1, slots=8)
    pool.decide(quiet, 200.0)
    decision = pool.decide(quiet, 205.0)
    assert decision is not None and (decision.direction, decision.reason) == (DOWN, "idle")
    assert "1 held" in decision.detail


def test_the_signals_count_the_requests_held_and_the_slots() -> None:
    loads = [load("decode-0", running=2, held=3), load("decode-1", running=1, held=1)]
    loads = [replace(one, max_num_seqs=4) for one in loads]
    signals = pool_signals("decode", {}, loads)
    assert (signals.held, signals.slots) == (4, 8)
    prefill = replace(load("prefill-0", running=2, waiting=5), role="prefill", max_num_seqs=8)
    assert pool_signals("prefill", {}, [prefill]).held == 7  # its engine's queue: nothing held apart


def test_a_calm_pool_between_low_water_and_target_stays() -> None:
    pool = PoolHysteresis("decode", CONFIG)
    calm = PoolSignals(workers=2, queue_depth=1.0, itl_s=0.05)  # 0.3 of the targets would be 0.6 and 0.03
    assert all(pool.decide(calm, now) is None for now in (0.0, 10.0, 100.0))


def test_a_full_pool_does_not_grow_and_the_bounds_act_at_once() -> None:
    pool = PoolHysteresis("decode", CONFIG)
    full = PoolSignals(workers=3, queue_depth=10.0)
    assert all(pool.decide(full, now) is None for now in (0.0, 10.0, 100.0))
    below = pool.decide(PoolSignals(workers=0), 100.5)
    assert below is not None and (below.direction, below.reason) == (UP, "below_min")
    above = PoolHysteresis("decode", CONFIG).decide(PoolSignals(workers=4), 0.0)
    assert above is not None and (above.direction, above.reason) == (DOWN, "above_max")


def test_each_pool_is_judged_by_its_own_signals() -> None:
    slow_prompts = PoolSignals(workers=1, ttft_s=3.0)
    slow_tokens = PoolSignals(workers=1, itl_s=0.5)
    for role, signals, grows in (("prefill", slow_prompts, True), ("decode", slow_prompts, False),
                                 ("decode", slow_tokens, True), ("prefill", slow_tokens, False)):
        pool = PoolHysteresis(role, CONFIG)
        pool.decide(signals, 0.0)
        decision = pool.decide(signals, 10.0)
        assert (decision is not None and decision.direction == UP) is grows, (role, signals)


def test_signals_count_only_what_happened_since_the_last_look() -> None:
    before = {"decode-0": load("decode-0", decode=[0, 0, 0, 0, 4], tokens=[0, 0, 0, 0, 0, 0])}
    # Since then: 2 requests decoding 1 s each over 2 + 5... tokens: decode 2 s for tokens summing to 20.
    now = load("decode-0", waiting=3, decode=[0, 0, 2, 0, 4], tokens=[0, 0, 0, 0, 0, 2])  # 2 x 10 tokens
    signals = pool_signals("decode", before, [now, load("decode-1", waiting=1)])
    assert signals.workers == 2 and signals.queue_depth == 2.0
    assert signals.itl_s == pytest.approx(2 * 1.0 / 20)


def test_a_decode_worker_queues_what_it_holds_beyond_its_running_requests() -> None:
    """Its engine's waiting queue stays empty: reserved requests and landed ones wait apart."""
    signals = pool_signals("decode", {}, [load("decode-0", running=2, held=7), load("decode-1", running=1, held=1)])
    assert signals.queue_depth == 2.5


def test_requests_reserved_for_their_kv_within_the_free_slots_do_not_queue() -> None:
    """A decode worker holding prompts that still compute elsewhere has no queue while its slots
    can take them all: a prefill-bound load must not grow the decode pool."""
    awaiting = replace(load("decode-0", running=0, held=2), max_num_seqs=2)  # both run once their KV lands
    assert pool_signals("decode", {}, [awaiting]).queue_depth == 0
    beyond = replace(load("decode-0", running=2, held=5), max_num_seqs=2)  # 3 wait for a slot
    assert pool_signals("decode", {}, [beyond]).queue_depth == 3


def test_a_restarted_worker_is_counted_from_zero() -> None:
    before = {"prefill-0": load("prefill-0", started_at=1.0, queue=[9, 0, 0, 0, 0])}
    restarted = load("prefill-0", started_at=2.0, queue=[0, 0, 0, 3, 0], prefill=[0, 1, 0, 0, 0])
    assert pool_signals("prefill", before, [restarted]).ttft_s == pytest.approx(2.0 + 0.5)


def test_ttft_is_the_p90_of_the_queue_and_prefill_buckets() -> None:
    assert quantile(None, 0.9) == 0.0
    counts = BucketCounts(BOUNDS, [8, 1, 1, 0, 0, 0])
    assert quantile(counts, 0.9) == 0.5
    assert quantile(BucketCounts(BOUNDS, [0, 0, 0, 0, 0, 3]), 0.9) == 5.0  # +Inf's: the last bound
    signals = pool_signals("prefill", {}, [load("prefill-0", queue=[10, 0, 0, 0, 0], prefill=[0, 0, 10, 0, 0])])
    assert signals.ttft_s == pytest.approx(0.1 + 1.0)


def test_the_scaling_section_is_read_and_checked() -> None:
    config = cluster_config_from({"scaling": {"enabled": True, "decode": {"min_workers": 1, "max_workers": 2},
                                              "sustain_s": 1}})
    assert config.scaling.decode == PoolBounds(1, 2) and config.scaling.sustain_s == 1
    assert not cluster_config_from({}).scaling.enabled
    with pytest.raises(ValueError, match="decode.replicas .3. must lie within scaling.decode"):
        cluster_config_from({"scaling": {"enabled": True, "decode": {"max_workers": 2}}, "decode": {"replicas": 3}})
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        PoolBounds(3, 2)
    with pytest.raises(ValueError, match="scaling.sustain_s must be >= 0"):
        ScalingConfig(sustain_s=-1)
    with pytest.raises(ValueError, match="scaling.scale_down_below"):
        ScalingConfig(scale_down_below=1.0)


def test_pdserve_status_prints_the_pools_and_the_last_decision() -> None:
    from cluster.cli import scaling_line

    status = {"pools": {"prefill": 1, "decode": 2}, "last": {"pool": "decode", "direction": "up",
                                                             "reason": "queue_depth", "detail": "queue_depth 3 > 2",
                                                             "worker": "decode-1"}}
    assert scaling_line(status) == "scaling: 2 decode, 1 prefill; last: decode up (queue_depth: queue_depth 3 > 2), " \
                                   "decode-1"
    assert scaling_line({"pools": {"decode": 1}, "last": {}}) == "scaling: 1 decode; no decision yet"
    with_spare = {"pools": {"decode": 1, "prefill": 1}, "spares": {"decode": ["decode-1"], "prefill": []}, "last": {}}
    assert scaling_line(with_spare) == "scaling: 1 decode (+1 warm spare), 1 prefill; no decision yet"


def test_a_colocated_pool_is_judged_by_ttft_and_itl_within_the_decode_bounds() -> None:
    """Its workers run both phases: slow prompts or slow tokens grow it, up to decode's max_workers."""
    for signals in (PoolSignals(workers=1, ttft_s=3.0), PoolSignals(workers=1, itl_s=0.5)):
        pool = PoolHysteresis("colocated", CONFIG)
        pool.decide(signals, 0.0)
        decision = pool.decide(signals, 10.0)
        assert decision is not None and decision.direction == UP, signals
    full = PoolHysteresis("colocated", replace(CONFIG, decode=PoolBounds(1, 1), prefill=PoolBounds(1, 3)))
    assert all(full.decide(PoolSignals(workers=1, ttft_s=3.0), now) is None for now in (0.0, 10.0))
    loads = [replace(load("colocated-0", queue=[10, 0, 0, 0, 0], prefill=[0, 0, 10, 0, 0], decode=[0, 0, 1, 0, 0],
                          tokens=[0, 0, 0, 0, 0, 1]), role="colocated")]
    signals = pool_signals("colocated", {}, loads)
    assert signals.ttft_s == pytest.approx(0.1 + 1.0) and signals.itl_s == pytest.approx(1.0 / 10.0)


STEP = replace(CONFIG, decode=PoolBounds(1, 2), queue_depth=0.5, sustain_s=1.0, scale_down_sustain_s=10.0,
               cooldown_s=5.0)  # grows early, gives back late (the load step benchmark's shape)


def test_a_pool_grows_after_sustain_s_and_shrinks_only_after_scale_down_sustain_s() -> None:
    """Hand-computed: over from 0 s, grown at 1 s (sustain_s 1); idle from 2 s: not shrunk at 3 s
    (sustain_s) nor at 6 s (the cooldown's end), but at 12 s (scale_down_sustain_s 10)."""
    pool = PoolHysteresis("decode", STEP)
    assert pool.decide(PoolSignals(workers=1, queue_depth=1.0), 0.0) is None
    grown = pool.decide(PoolSignals(workers=1, queue_depth=1.0), 1.0)
    assert grown is not None and (grown.direction, grown.since) == (UP, 0.0)
    assert all(pool.decide(IDLE, now) is None for now in (2.0, 3.0, 6.0, 11.9))
    shrunk = pool.decide(IDLE, 12.0)
    assert shrunk is not None and (shrunk.direction, shrunk.reason, shrunk.since) == (DOWN, "idle", 2.0)
    assert "for 10.0 s" in shrunk.detail


def test_a_load_step_grows_the_pool_once_and_gives_the_worker_back_once_after_it() -> None:
    """No flapping: a look-by-look trace (0.5 s) of a burst shorter than sustain_s, a step whose queue
    comes and goes while the slots stay busy, lulls inside it, then quiet: one UP, one DOWN."""
    trace = [(0.0, PoolSignals(workers=1, held=1, slots=2)),
             (10.0, PoolSignals(workers=1, queue_depth=1.0, held=3, slots=2)),  # a burst of 0.5 s
             (10.5, PoolSignals(workers=1, held=2, slots=2))]
    trace += [(20.0 + 0.5 * i, PoolSignals(workers=1, queue_depth=float(q), held=2 + q, slots=2))
              for i, q in enumerate((0, 1, 1, 2, 2, 3))]  # the step: the queue builds
    trace += [(23.0 + 0.5 * i, PoolSignals(workers=2, queue_depth=float(i % 4 == 0), held=2 + i % 2, slots=4))
              for i in range(40)]  # two workers run it: a request waits now and then, the slots stay busy
    trace += [(43.0 + 0.5 * i, PoolSignals(workers=2, held=i % 5 // 4, slots=4)) for i in range(20)]  # lulls of 2 s
    trace += [(53.0 + 0.5 * i, PoolSignals(workers=2 if i < 21 else 1, held=0, slots=4)) for i in range(60)]
    pool = PoolHysteresis("decode", STEP)
    decisions = [(now, decision.direction) for now, signals in _looks(trace)
                 if (decision := pool.decide(signals, now)) is not None]
    assert decisions == [(21.5, UP), (63.0, DOWN)]  # over from 20.5 s (1 s); under from 53 s (10 s)


def _looks(trace: list[tuple[float, PoolSignals]]) -> list[tuple[float, PoolSignals]]:
    """Every 0.5 s look from the trace's first to its last, each seeing the latest signals."""
    looks, index = [], 0
    for step in range(int(trace[-1][0] / 0.5) + 1):
        now = step * 0.5
        while index + 1 < len(trace) and trace[index + 1][0] <= now:
            index += 1
        looks.append((now, trace[index][1]))
    return looks


def test_the_warm_spares_and_the_shrinking_sustain_are_read_and_checked() -> None:
    config = cluster_config_from({"scaling": {"enabled": True, "warm_spares": 1, "scale_down_sustain_s": 30,
                                              "sustain_s": 1}})
    assert (config.scaling.warm_spares, config.scaling.down_sustain_s) == (1, 30)
    assert cluster_config_from({"scaling": {"sustain_s": 7, "scale_down_sustain_s": None}}).scaling.down_sustain_s == 7
    with pytest.raises(ValueError, match="scaling.warm_spares must be >= 0"):
        ScalingConfig(warm_spares=-1)
    with pytest.raises(ValueError, match="scaling.scale_down_sustain_s must be >= 0"):
        ScalingConfig(scale_down_sustain_s=-1.0)
    with pytest.raises(ValueError, match="scaling.warm_spares needs redis_url empty"):
        cluster_config_from({"scaling": {"enabled": True, "warm_spares": 1}, "redis_url": "redis://localhost:6379/0"})
