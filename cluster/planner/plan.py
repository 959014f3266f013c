"""The planner: the cluster shape with the highest goodput per worker for a workload and its SLOs.

Goodput per worker is DistServe's figure of merit: requests per second that meet both the TTFT and
the TPOT SLO, divided by the workers that serve them. A shape is eligible only when at least
`attainment` of its requests meet both SLOs (otherwise one worker missing most of them would win);
among eligible shapes the planner takes the highest goodput per worker, then the fewest workers,
then colocated (one pool is simpler to run), then the engine's default limits (a limit changed for
nothing is a knob to explain). With none eligible it reports the best attainment and
says so. Every candidate is simulated on the same requests (`cluster.planner.simulator`).

The search: colocated with 1..budget workers, and every prefill/decode split of 2..budget workers;
for each, the token budgets and batch limits in `SearchSpace`. By default both pools share their
limits (one `engine:` section); `per_pool` searches them apart, and `to_cluster_config` writes such
a plan as each pool's own `engine:` section.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from cluster.planner.profile import Profile
from cluster.planner.simulator import COLOCATED, DISAGGREGATED, PoolLimits, SimResult, Topology, simulate
from cluster.planner.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLOs must be > 0, got ttft {self.ttft_s} s and tpot {self.tpot_s} s")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")


@dataclass(frozen=True, slots=True)
class SearchSpace:
    budget: int
    token_budgets: tuple[int, ...] = (256, 512, 1024, 2048)
    max_num_seqs: tuple[int, ...] = (16, 64, 256)
    modes: tuple[str, ...] = (COLOCATED, DISAGGREGATED)
    per_pool: bool = False

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError(f"budget (workers) must be >= 1, got {self.budget}")
        if not self.token_budgets or not self.max_num_seqs or min(self.token_budgets + self.max_num_seqs) < 1:
            raise ValueError("token budgets and batch limits must be non-empty lists of values >= 1")

    def topologies(self) -> Iterator[Topology]:
        limits = [PoolLimits(t, s) for t, s in itertools.product(self.token_budgets, self.max_num_seqs)]
        if COLOCATED in self.modes:
            for workers, pool in itertools.product(range(1, self.budget + 1), limits):
                yield Topology(COLOCATED, 0, workers, pool, pool)
        if DISAGGREGATED not in self.modes:
            return
        pairs = itertools.product(limits, limits) if self.per_pool else ((pool, pool) for pool in limits)
        for (prefill_pool, decode_pool), total in itertools.product(list(pairs), range(2, self.budget + 1)):
            for prefill in range(1, total):
                yield Topology(DISAGGREGATED, prefill, total - prefill, prefill_pool, decode_pool)


@dataclass(frozen=True, slots=True)
class Candidate:
    topology: Topology
    result: SimResult = field(repr=False)
    goodput: float
    attainment: float

    @property
    def goodput_per_worker(self) -> float:
        return self.goodput / self.topology.num_workers

    def rank(self, slo: Slo) -> tuple[Any, ...]:
        """Sorts best first."""
        eligible = self.attainment >= slo.attainment
        return (not eligible, -round(self.goodput_per_worker, 9) if eligible else -self.attainment,
                self.topology.num_workers, self.topology.mode != COLOCATED, not self.default_limits)

    @property
    def default_limits(self) -> bool:
        """Both pools at the engine's defaults: among shapes that tie, the plan changes no limit that
        buys nothing (and a default-limit shape is the cluster an operator would run anyway)."""
        return self.topology.prefill_limits == PoolLimits() == self.topology.decode_limits


@dataclass(frozen=True, slots=True)
class Plan:
    slo: Slo
    ranked: list[Candidate]

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    @property
    def runner_up(self) -> Candidate | None:
        """The best candidate of another pool shape (a different split or mode, not just limits)."""
        shape = _shape(self.best.topology)
        return next((c for c in self.ranked[1:] if _shape(c.topology) != shape), None)

    @property
    def meets_slo(self) -> bool:
        return self.best.attainment >= self.slo.attainment


def _shape(topology: Topology) -> tuple[str, int, int]:
    return topology.mode, topology.num_prefill if topology.mode == DISAGGREGATED else 0, topology.num_decode


def plan(profile: Profile, specs: list[RequestSpec], slo: Slo, space: SearchSpace,
         on_candidate: Callable[[], None] | None = None) -> Plan:
    candidates = []
    for topology in space.topologies():
        result = simulate(profile, topology, specs)
        candidates.append(Candidate(topology, result, result.goodput(slo.ttft_s, slo.tpot_s),
                                    result.attainment(slo.ttft_s, slo.tpot_s)))
        if on_candidate is not None:
            on_candidate()
    return Plan(slo, sorted(candidates, key=lambda candidate: candidate.rank(slo)))


def count_topologies(space: SearchSpace) -> int:
    return sum(1 for _ in space.topologies())
