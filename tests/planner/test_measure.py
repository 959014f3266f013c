"""The profile's decode points are steady-state steps, not the cold ones right after a prompt."""

from __future__ import annotations

from cluster.planner.measure import steady_median


def test_steady_median_drops_the_warmup_steps_and_takes_the_median_of_the_rest():
    # Three cold steps (after the prompts) at 50 ms, then steady steps of 30-34 ms: the median of
    # the five after the warm-up is 32 ms; with the cold ones in it would be 34 or more.
    times = iter([0.05, 0.05, 0.05, 0.031, 0.034, 0.032, 0.030, 0.033, 0.5])
    calls = []

    def step() -> float:
        calls.append(1)
        return next(times)

    assert steady_median(step, warmup=3, count=5) == 0.032
    assert len(calls) == 8  # never the ninth
