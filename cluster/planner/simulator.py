"""A discrete-event simulator of a pdserve cluster, driven by a worker profile and a workload.

What it models, as the code decides it:
- the router (`cluster.ray_cluster.router`, `routing_policy`): a request goes to the decode (or
  colocated) worker with the fewest requests in flight there, which reserves its blocks at once;
  in disaggregated mode the prefill worker is the one with the fewest prompt tokens queued;
- each worker's engine (`cluster.engine.scheduler.Scheduler`): one step at a time; running requests
  first, each taking the tokens it still needs under `max_num_batched_tokens`; then (decode side)
  requests whose KV arrived, one token each; then waiting requests in arrival order while fewer
  than `max_num_seqs` run, their prompts chunked into what budget is left. A step lasts what the
  profile says for its chunks and decode rows (`Profile.step_seconds`);
- the prefill worker samples the first token at the end of the prompt's last chunk (the client's
  TTFT: it streams from there), then the KV travels (`Profile.transfer_seconds_for`; with
  `kv_overlap` only the last chunk's blocks are left to send, the rest went while it computed) and
  the decode worker admits the request at its next step.
- serving's fixed latencies (`Profile.serving_for(mode)`): a request reaches its worker's queue
  `first_token_s` after it arrives (its hops there and its first token's way back, taken together:
  a constant delay of every token leaves the gaps alone), and a served worker's step lasts
  `step_factor` times the engine's alone (a colocated or prefill worker: the factor is timed on
  prompts), plus `step_s`;
- workers sharing cores: when the workers' threads (`Profile.threads` each) and the front door's
  CPU (`front_door_cores`: the router, Ray, the workers' event loops, the client, in cores, from
  the workload's average request and token rates) outnumber the cores (`Topology.cores`, or the
  profiled machine's), every step takes (workers x threads + front door) / cores times its profiled
  time (`oversubscription`): each worker gets that share of the cores it was profiled with.
  Pessimistic while some workers idle, as their cores then go to the busy ones.
What it leaves out (docs/planner.md): preemption and KV capacity, prefix caching, the admission
limits (429s), the router's load polls, and cores taken by processes outside the cluster.
Standard library only: a plan simulates hundreds of configurations in seconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cluster.planner.profile import Profile, Serving
from cluster.planner.workload import RequestSpec

COLOCATED = "colocated"
DISAGGREGATED = "disaggregated"


@dataclass(frozen=True, slots=True)
class PoolLimits:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"pool limits must be >= 1, got {self}")


@dataclass(frozen=True, slots=True)
class Topology:
    """A cluster's shape: colocated workers (`num_decode` of them) or a prefill and a decode pool."""

    mode: str = DISAGGREGATED
    num_prefill: int = 1
    num_decode: int = 1
    prefill_limits: PoolLimits = field(default_factory=PoolLimits)
    decode_limits: PoolLimits = field(default_factory=PoolLimits)
    kv_overlap: bool = True
    cores: int = 0  # the machine's cores the workers share (0: the profiled machine's)

    def __post_init__(self) -> None:
        if self.mode not in (COLOCATED, DISAGGREGATED):
            raise ValueError(f"mode must be {COLOCATED!r} or {DISAGGREGATED!r}, got {self.mode!r}")
        if self.num_decode < 1 or (self.mode == DISAGGREGATED and self.num_prefill < 1):
            raise ValueError(f"a {self.mode} cluster needs its workers, got {self}")
        if self.cores < 0:
            raise ValueError(f"cores must be >= 0 (0: the profiled machine's), got {self.cores}")

    @property
    def num_workers(self) -> int:
        return self.num_decode + (self.num_prefill if self.mode == DISAGGREGATED else 0)

    def describe(self) -> str:
        if self.mode == COLOCATED:
            return f"{self.num_decode} colocated"
        return f"{self.num_prefill}P+{self.num_decode}D"


@dataclass(slots=True)
class SimRequest:
    spec: RequestSpec
    computed: int = 0  # prompt tokens whose KV exists (on the worker running the request)
    generated: int = 0
    token_times: list[float] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.spec.prompt_tokens

    @property
    def done(self) -> bool:
        return self.generated >= self.spec.output_tokens


class SimWorker:
    """One engine's queues and its scheduling rule (`Scheduler.schedule`, without preemption)."""

    def __init__(self, index: int, limits: PoolLimits) -> None:
        self.index = index
        self.limits = limits
        self.waiting: deque[SimRequest] = deque()
        self.remote_ready: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy = False
        self.in_flight = 0  # the router's count of requests here (decode side)
        self.queued_tokens = 0  # the router's count of prompt tokens to compute here (prefill side)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.remote_ready or self.running)

    def schedule(self) -> list[tuple[SimRequest, int]]:
        budget, rows = self.limits.max_num_batched_tokens, []
        for request in self.running:
            if budget <= 0:
                break
            num_new = min(request.spec.prompt_tokens - request.computed if request.prefilling else 1, budget)
            rows.append((request, num_new))
            budget -= num_new
        while self.remote_ready and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.remote_ready.popleft()
            self.running.append(request)
            rows.append((request, 1))
            budget -= 1
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting.popleft()
            self.running.append(request)
            num_new = min(request.spec.prompt_tokens - request.computed, budget)
            rows.append((request, num_new))
            budget -= num_new
        return rows


@dataclass(frozen=True, slots=True)
class RequestResult:
    spec: RequestSpec
    token_times: tuple[float, ...]

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.spec.arrival_s

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def tpot_s(self) -> float:
        count = len(self.token_times) - 1
        return (self.token_times[-1] - self.token_times[0]) / count if count else 0.0

    @property
    def finish_s(self) -> float:
        return self.token_times[-1]


def percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class SimResult:
    topology: Topology
    requests: list[RequestResult]

    @property
    def duration_s(self) -> float:
        start = min(result.spec.arrival_s for result in self.requests)
        return max(max(result.finish_s for result in self.requests) - start, 1e-9)

    def meets(self, result: RequestResult, slo_ttft_s: float, slo_tpot_s: float) -> bool:
        return result.ttft_s <= slo_ttft_s and result.tpot_s <= slo_tpot_s

    def attainment(self, slo_ttft_s: float, slo_tpot_s: float) -> float:
        return sum(self.meets(r, slo_ttft_s, slo_tpot_s) for r in self.requests) / len(self.requests)

    def goodput(self, slo_ttft_s: float, slo_tpot_s: float) -> float:
        """Requests per second that met both SLOs, over the run (first arrival to last token)."""
        return sum(self.meets(r, slo_ttft_s, slo_tpot_s) for r in self.requests) / self.duration_s

    def summary(self) -> dict[str, Any]:
        ttfts = [r.ttft_s for r in self.requests]
        tpots = [r.tpot_s for r in self.requests if len(r.token_times) > 1]
        itls = [gap for r in self.requests for gap in r.itls_s]
        figures: dict[str, Any] = {"topology": self.topology.describe(), "num_requests": len(self.requests),
                                   "duration_s": self.duration_s}
        for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls)):
            for q in (50, 90, 99):
                figures[f"{name}_p{q}_s"] = percentile(values, q)
        return figures


def oversubscription(profile: Profile, topology: Topology, front_door: float = 0.0) -> float:
    """How much longer each step takes because the workers' threads and the front door's CPU
    (`front_door`, in cores) outnumber the cores: each of `workers x threads` threads gets
    `cores / (workers x threads + front door)` of a core, so a step profiled on `threads` cores of
    its own takes `(workers x threads + front door) / cores` times as long. 1 when they fit, or when
    the profile does not say its threads or cores."""
    cores = topology.cores or profile.cores
    if not cores or not profile.threads:
        return 1.0
    return max(1.0, (topology.num_workers * profile.threads + front_door) / cores)


def front_door_cores(serving: Serving, specs: list[RequestSpec]) -> float:
    """The cores the front door takes while the workload runs: its idle rate, plus its per-request
    and per-token CPU at the workload's average rates (requests and output tokens over the span of
    the arrivals: as if the cluster keeps up). A burst at one instant has no span: the idle rate."""
    span = max(spec.arrival_s for spec in specs) - min(spec.arrival_s for spec in specs) if specs else 0.0
    if span <= 0:
        return serving.front_door_idle_cores
    cpu_s = len(specs) * serving.front_door_request_cpu_s \
        + sum(spec.output_tokens for spec in specs) * serving.front_door_token_cpu_s
    return serving.front_door_idle_cores + cpu_s / span


def serving_from_lone_requests(profile: Profile, topology: Topology, prompt_tokens: int, ttft_s: float,
                               token_gap_s: float, long_prompt_tokens: int = 0, long_ttft_s: float = 0.0) -> Serving:
    """The serving latencies that make the simulator reproduce what a client timed on requests sent
    alone to that cluster: a `prompt_tokens`-token request's TTFT, its steady token gap (one decode
    row at about that context) and, given, a `long_prompt_tokens`-token request's TTFT. The inverse
    of `Simulation` for lone requests: the two TTFTs differ by factor x (their prefill steps'
    difference) x slowdown, the fixed latencies cancelling, which gives `step_factor`; the gap is
    (factor x decode step + `step_s`) x slowdown (disaggregated: the decode worker's, without the
    factor, `Simulation.step_factor`), the TTFT `first_token_s` + (factor x prefill +
    `step_s`) x slowdown. What the profile already explains is never negative serving, nor a factor
    under 1 (a served worker is never faster than the engine alone): clamped."""
    slowdown = oversubscription(profile, topology)
    factor = 1.0
    if long_prompt_tokens > prompt_tokens:
        profiled = profile.prefill_seconds(long_prompt_tokens, 0) - profile.prefill_seconds(prompt_tokens, 0)
        if profiled > 0:
            factor = max((long_ttft_s - ttft_s) / slowdown / profiled, 1.0)
    decode_factor = factor if topology.mode == COLOCATED else 1.0  # see `Simulation.step_factor`
    step_s = max(token_gap_s / slowdown - decode_factor * profile.decode_seconds(1, prompt_tokens), 0.0)
    first_token_s = ttft_s - (factor * profile.prefill_seconds(prompt_tokens, 0) + step_s) * slowdown
    return Serving(first_token_s=max(first_token_s, 0.0), step_s=step_s, step_factor=factor)


class Simulation:
    """One run: events in time order, workers stepping, the router placing each arrival."""

    def __init__(self, profile: Profile, topology: Topology) -> None:
        self.profile = profile
        self.topology = topology
        colocated = topology.mode == COLOCATED
        self.prefill = [] if colocated else [SimWorker(i, topology.prefill_limits)
                                             for i in range(topology.num_prefill)]
        self.decode = [SimWorker(i, topology.decode_limits) for i in range(topology.num_decode)]
        self.events: list[tuple[float, int, str, Any]] = []
        self.sequence = itertools.count()
        self.decode_of: dict[int, SimWorker] = {}  # id(request) -> its decode (or colocated) worker
        self.steps: dict[int, list[tuple[SimRequest, int]]] = {}  # id(worker) -> the step it runs
        self.serving = profile.serving_for(topology.mode)
        self.slowdown = oversubscription(profile, topology)

    def run(self, specs: list[RequestSpec]) -> SimResult:
        self.slowdown = oversubscription(self.profile, self.topology, front_door_cores(self.serving, specs))
        requests = [SimRequest(spec) for spec in specs]
        for request in requests:
            self._push(request.spec.arrival_s + self.serving.first_token_s, "arrival", request)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            getattr(self, f"_on_{kind}")(now, payload)
        unfinished = [request for request in requests if not request.done]
        if unfinished:  # a bug in the model, never a result to report
            raise RuntimeError(f"{len(unfinished)} simulated requests never finished")
        return SimResult(self.topology, [RequestResult(r.spec, tuple(r.token_times)) for r in requests])

    def _push(self, when: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.events, (when, next(self.sequence), kind, payload))

    def _on_arrival(self, now: float, request: SimRequest) -> None:
        decode = min(self.decode, key=lambda worker: (worker.in_flight, worker.index))
        decode.in_flight += 1
        self.decode_of[id(request)] = decode
        if not self.prefill:
            self._enqueue(now, decode, request)
            return
        prefill = min(self.prefill, key=lambda worker: (worker.queued_tokens, worker.index))
        prefill.queued_tokens += request.spec.prompt_tokens
        self._enqueue(now, prefill, request)

    def _on_kv_arrived(self, now: float, request: SimRequest) -> None:
        worker = self.decode_of[id(request)]
        worker.remote_ready.append(request)
        self._start(now, worker)

    def _enqueue(self, now: float, worker: SimWorker, request: SimRequest) -> None:
        worker.waiting.append(request)
        self._start(now, worker)

    def _start(self, now: float, worker: SimWorker) -> None:
        if worker.busy or not worker.has_work:
            return
        rows = worker.schedule()
        if not rows:
            return
        chunks = [(num_new, request.computed) for request, num_new in rows if request.prefilling]
        contexts = [request.spec.prompt_tokens + request.generated for request, _ in rows if not request.prefilling]
        worker.busy = True
        self.steps[id(worker)] = rows
        engine_s = self.profile.step_seconds(chunks, contexts) * self.step_factor(worker)
        seconds = (engine_s + self.serving.step_s) * self.slowdown
        self._push(now + seconds, "step_done", worker)

    def step_factor(self, worker: SimWorker) -> float:
        """The served step factor is timed on prompts, which a colocated or prefill worker runs; a
        disaggregated decode worker's served cost is `step_s` alone, timed on its own token gap."""
        return 1.0 if self.prefill and worker not in self.prefill else self.serving.step_factor

    def _on_step_done(self, now: float, worker: SimWorker) -> None:
        worker.busy = False
        is_prefill = worker in self.prefill
        for request, num_new in self.steps.pop(id(worker)):
            was_prefilling = request.prefilling
            if was_prefilling:
                request.computed += num_new
                if request.prefilling:
                    continue  # a chunk: no token yet
            request.generated += 1
            request.token_times.append(now)
            if is_prefill:
                self._hand_over(now, worker, request, num_new)
            elif request.done:
                self._finish(worker, request)
        self._start(now, worker)

    def _hand_over(self, now: float, worker: SimWorker, request: SimRequest, last_chunk: int) -> None:
        """The prompt is computed and its first token sampled: its KV goes to the decode worker."""
        worker.running.remove(request)
        worker.queued_tokens -= request.spec.prompt_tokens
        if request.done:
            self._finish(None, request)
            return
        unsent = last_chunk if self.topology.kv_overlap else request.spec.prompt_tokens
        self._push(now + self.profile.transfer_seconds_for(unsent), "kv_arrived", request)

    def _finish(self, worker: SimWorker | None, request: SimRequest) -> None:
        if worker is not None:
            worker.running.remove(request)
        self.decode_of.pop(id(request)).in_flight -= 1


def simulate(profile: Profile, topology: Topology, specs: list[RequestSpec]) -> SimResult:
    return Simulation(profile, topology).run(specs)
