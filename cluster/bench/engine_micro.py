"""Decode-step microbenchmarks (`benchmarks.engine`): the engine's step against its linear layers,
and the host-side cost of scheduling and batch building with the model call stubbed out
(`stub_prefill`, `fake_tokens`); `Timers` times the engine's own call sites in place."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from rich.progress import Progress
from torch import nn

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.kv_cache_manager import cdiv
from cluster.engine.llm_engine import LLMEngine
from cluster.model import elementwise
from cluster.model.sampler import Sampler
from pdserve_kernels import reference

# Long enough that no request finishes while it is being measured.
NEVER_ENDING = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


class Timers:
    """Seconds spent per named section, accumulated; wraps callables so the engine's own call sites
    are timed in place (a perf_counter pair per call, a few hundred nanoseconds)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        totals = self.totals

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - start

        return timed

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The totals so far, then zero."""
        totals = dict(self.totals)
        self.totals.clear()
        return totals


def fake_tokens(count: int, rng: np.random.Generator) -> list[int]:
    # Ordinary vocabulary ids, as synthetic_workload uses: no special tokens.
    return rng.integers(1000, 30000, count).tolist()


def stub_prefill(engine: LLMEngine, rng: np.random.Generator) -> int:
    """Advance every queued request to steady decode without a forward pass: the scheduler admits
    and 'computes' prompts, sampled tokens are made up. KV slots keep their zeros, which changes no
    timing: every op of a decode step costs the same whatever the values. Returns the steps taken."""
    scheduler, steps = engine.scheduler, 0
    while scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
        output = scheduler.schedule()
        sampled = {s.request.request_id: [token] for s, token in
                   zip(output.scheduled, fake_tokens(len(output.scheduled), rng), strict=True) if s.samples}
        scheduler.update_from_output(output, sampled)
        steps += 1
    return steps


def decode_engine(dtype: str, num_seqs: int, prompt_len: int, num_blocks: int, seed: int = 0,
                  kv_cache_dtype: str = "auto") -> LLMEngine:
    """An engine holding `num_seqs` requests of `prompt_len` tokens, queued (not yet prefilled)."""
    config = EngineConfig(
        model=ModelConfig(dtype=dtype), cache=CacheConfig(num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype),
        # One step can take every prompt at once, so a real prefill is as short as it can be.
        scheduler=SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs * prompt_len)))
    engine = LLMEngine(config)
    rng = np.random.default_rng(seed)
    for _ in range(num_seqs):
        engine.add_request(fake_tokens(prompt_len, rng), NEVER_ENDING)
    return engine


def blocks_for(num_seqs: int, tokens_per_seq: int, block_size: int = 16) -> int:
    return num_seqs * (cdiv(tokens_per_seq, block_size) + 1)


def prefill(engine: LLMEngine, real: bool, seed: int = 0) -> float:
    """Bring every request to steady decode: by running the model, or by the scheduler alone."""
    start = time.perf_counter()
    if real:
        scheduler = engine.scheduler
        while scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in scheduler.running):
            engine.step()
    else:
        stub_prefill(engine, np.random.default_rng(seed))
    return time.perf_counter() - start


class TimedSampler:
    """Stands in for the runner's sampler (called through `__call__`, which an instance attribute
    cannot replace) and times it; everything else goes to the real one."""

    def __init__(self, sampler: Sampler, timers: Timers) -> None:
        self.sampler = sampler
        self.call = timers.wrap("sampler", sampler.__call__)

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


def instrument(engine: LLMEngine, timers: Timers) -> None:
    """Time the parts of `engine.step()` at their own call sites (instance attributes shadow methods)."""
    scheduler, runner, model = engine.scheduler, engine.runner, engine.runner.model
    scheduler.schedule = timers.wrap("scheduler", scheduler.schedule)  # type: ignore[method-assign]
    scheduler.update_from_output = timers.wrap("scheduler", scheduler.update_from_output)  # type: ignore[method-assign]
    runner.build_batch = timers.wrap("build_batch", runner.build_batch)  # type: ignore[method-assign]
    model.forward = timers.wrap("model", model.forward)  # type: ignore[method-assign]
    attention: Any = model.model.layers[0].self_attn
    backend = attention.backend  # one backend object shared by every layer
    backend.forward = timers.wrap("attention", backend.forward)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            name = "lm_head" if module is model.lm_head else "linear"
            module.forward = timers.wrap(name, module.forward)  # type: ignore[method-assign]
    runner.sampler = TimedSampler(runner.sampler, timers)  # type: ignore[assignment]
    # The torch backend calls these through their modules, so patching a module times them inside
    # attention; the KV write at `elementwise`, which picks the C write or torch's (both counted once).
    for source, name in ((reference, "gather_kv"), (elementwise, "write_kv_cache")):
        original = getattr(getattr(source, name), "original", getattr(source, name))
        wrapped = timers.wrap(f"attention_{name}", original)
        wrapped.original = original  # type: ignore[attr-defined]
        setattr(source, name, wrapped)
    engine._output = timers.wrap("outputs", engine._output)  # type: ignore[method-assign]


def breakdown(totals: dict[str, float], step: float) -> dict[str, float]:
    """Exclusive parts of one step, in seconds; `other` is what no timer saw (runner glue, loops)."""
    parts = {
        "scheduler": totals.get("scheduler", 0.0),
        "build_batch": totals.get("build_batch", 0.0),
        "attention_kv_write": totals.get("attention_write_kv_cache", 0.0),
        "attention_gather": totals.get("attention_gather_kv", 0.0),
        "attention_sdpa_mask": totals.get("attention", 0.0) - totals.get("attention_write_kv_cache", 0.0)
        - totals.get("attention_gather_kv", 0.0),
        "linear": totals.get("linear", 0.0),
        "rest_of_model": totals.get("model", 0.0) - totals.get("attention", 0.0) - totals.get("linear", 0.0),
        "lm_head": totals.get("lm_head", 0.0),
        "sampler": totals.get("sampler", 0.0),
        "outputs": totals.get("outputs", 0.0),
    }
    parts["other"] = step - sum(parts.values())
    return parts


def linear_inputs(model: nn.Module, rows: int, dtype: torch.dtype) -> list[tuple[nn.Linear, torch.Tensor]]:
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return [(layer, torch.randn(rows, layer.in_features, dtype=dtype)) for layer in layers]


@torch.inference_mode()
def linear_pass(pairs: list[tuple[nn.Linear, torch.Tensor]]) -> float:
    """Every linear layer once, in order, through F.linear (the layers' own forward is being timed)."""
    start = time.perf_counter()
    for layer, x in pairs:
        nn.functional.linear(x, layer.weight, layer.bias)
    return time.perf_counter() - start


def profile_step(engine: LLMEngine, top: int = 12) -> list[dict[str, Any]]:
    """torch.profiler's op table for one step: where the model's time goes, op by op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in events]


def step_vs_linear_one(dtype: str, num_seqs: int, prompt_len: int, iterations: int,
                       real_prefill: bool, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    engine = decode_engine(dtype, num_seqs, prompt_len, blocks_for(num_seqs, prompt_len + iterations + 64),
                           kv_cache_dtype=kv_cache_dtype)
    prefill_s = prefill(engine, real_prefill)
    timers = Timers()
    instrument(engine, timers)
    pairs = linear_inputs(engine.runner.model, num_seqs, engine.runner.dtype)
    for _ in range(2):  # warm-up: first calls allocate and pick kernels
        engine.step()
        linear_pass(pairs)
    timers.take()
    steps, linears, parts = [], [], []
    with Progress(transient=True) as bar:
        task = bar.add_task(f"{dtype}: step / linear", total=iterations)
        for _ in range(iterations):
            # Interleaved, so both see the same machine load.
            start = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - start)
            assert len(outputs) == num_seqs, "every request should decode once per step"
            parts.append(breakdown(timers.take(), steps[-1]))
            linears.append(linear_pass(pairs))
            bar.advance(task)
    ops = profile_step(engine)
    step_med, linear_med = median(steps), median(linears)
    return {
        "dtype": dtype, "kv_cache_dtype": engine.kv_cache_dtype, "num_seqs": num_seqs, "prompt_len": prompt_len,
        "real_prefill": real_prefill,
        "prefill_s": prefill_s, "context_len_at_end": engine.scheduler.running[0].num_tokens,
        "step_s": steps, "linear_s": linears, "step_median_s": step_med, "linear_median_s": linear_med,
        "ratio_median": step_med / linear_med, "ratio_min": min(steps) / min(linears),
        "breakdown_median_s": {key: median([p[key] for p in parts]) for key in parts[0]},
        "num_linear_layers": len(pairs), "profile_top_ops": ops, "target_met": step_med <= 2 * linear_med,
    }


def stub_step(engine: LLMEngine, rng: np.random.Generator) -> tuple[float, float, float, float]:
    """One decode step with no model: (schedule, build_batch, update_from_output, outputs) seconds."""
    scheduler, runner = engine.scheduler, engine.runner
    t0 = time.perf_counter()
    output = scheduler.schedule()
    t1 = time.perf_counter()
    batch = runner.build_batch(output.scheduled)
    t2 = time.perf_counter()
    requests = [batch.rows[row].request for row in batch.sample_rows]
    tokens = fake_tokens(len(requests), rng)
    scheduler.update_from_output(output, {r.request_id: [t] for r, t in zip(requests, tokens, strict=True)})
    t3 = time.perf_counter()
    for request, token in zip(requests, tokens, strict=True):  # what engine.step does per output
        engine._output(request, [token], [])
    t4 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, t4 - t3


def python_hot_spots(engine: LLMEngine, steps: int, top: int = 15) -> list[dict[str, Any]]:
    """cProfile of stub steps: the Python functions the host-side time goes to."""
    rng = np.random.default_rng(1)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        stub_step(engine, rng)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{file.split('/pdserve/')[-1].split('/main/')[-1]}:{line}({name})",
                     "calls_per_step": calls / steps, "tottime_us_per_step": tottime / steps * 1e6,
                     "cumtime_us_per_step": cumtime / steps * 1e6})
    return sorted(rows, key=lambda r: r["tottime_us_per_step"], reverse=True)[:top]


def scheduler_cost_one(num_seqs: int, prompt_len: int, steps: int, real_steps: int) -> dict[str, Any]:
    total_steps = steps * 2 + real_steps + 8  # measured + profiled + real, with slack
    engine = decode_engine("float32", num_seqs, prompt_len, blocks_for(num_seqs, prompt_len + total_steps))
    stub_prefill(engine, np.random.default_rng(0))
    rng = np.random.default_rng(0)
    for _ in range(5):  # warm-up
        stub_step(engine, rng)
    samples = []
    with Progress(transient=True) as bar:
        task = bar.add_task(f"{num_seqs} running: stub steps", total=steps)
        for _ in range(steps):
            samples.append(stub_step(engine, rng))
            bar.advance(task)
    hot = python_hot_spots(engine, steps)
    real = []
    for _ in range(real_steps):
        start = time.perf_counter()
        engine.step()
        real.append(time.perf_counter() - start)
    columns = list(zip(*samples, strict=True))
    schedule, build, update, outputs = (median(list(c)) for c in columns)
    host = median([s[0] + s[1] + s[2] for s in samples])
    real_med = median(real[1:]) if len(real) > 1 else median(real)
    return {
        "num_seqs": num_seqs, "prompt_len": prompt_len, "steps": steps,
        "schedule_median_s": schedule, "build_batch_median_s": build, "update_median_s": update,
        "outputs_median_s": outputs, "host_median_s": host, "host_p90_s": float(np.percentile(
            [s[0] + s[1] + s[2] for s in samples], 90)),
        "real_step_s": real, "real_step_median_s": real_med, "fraction_of_real_step": host / real_med,
        "fraction_with_outputs": (host + outputs) / real_med, "python_hot_spots": hot,
    }


def threads_one(num_seqs: int, prompt_len: int, thread_counts: list[int], repeats: int) -> dict[str, Any]:
    """The same decode step and the same elementwise op under different intra-op thread counts,
    interleaved so that each count sees the same machine load."""
    engine = decode_engine("float32", num_seqs, prompt_len, blocks_for(num_seqs, prompt_len + 4 * repeats + 8))
    stub_prefill(engine, np.random.default_rng(0))
    x, y = torch.randn(1 << 20), torch.randn(1 << 20)
    steps: dict[int, list[float]] = {n: [] for n in thread_counts}
    muls: dict[int, list[float]] = {n: [] for n in thread_counts}
    for _ in range(repeats):
        for n in thread_counts:
            torch.set_num_threads(n)
            start = time.perf_counter()
            engine.step()
            steps[n].append(time.perf_counter() - start)
            start = time.perf_counter()
            for _ in range(10):
                torch.mul(x, y)
            muls[n].append((time.perf_counter() - start) / 10)
    return {"num_seqs": num_seqs, "prompt_len": prompt_len,
            "runs": [{"threads": n, "step_median_s": median(steps[n]), "mul_1m_median_s": median(muls[n]),
                      "step_s": steps[n], "mul_1m_s": muls[n]} for n in thread_counts]}


def prefill_vs_linear_one(dtype: str, prompt_len: int, iterations: int, seed: int = 0) -> dict[str, Any]:
    """One prompt of `prompt_len` tokens computed in one step (a fresh random prompt each time: no
    cache hit), against the model's linear layers alone on `prompt_len` rows. The lm_head is left out
    of the limit: a prefill runs it on the last position only."""
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(dtype=dtype), cache=CacheConfig(num_blocks=blocks_for(1, prompt_len + 16)),
        scheduler=SchedulerConfig(max_num_batched_tokens=prompt_len)))
    model = engine.runner.model
    pairs = [(layer, x) for layer, x in linear_inputs(model, prompt_len, engine.runner.dtype)
             if layer is not model.lm_head]
    rng = np.random.default_rng(seed)
    prefills, linears = [], []
    for index in range(iterations + 1):  # the first of each is a warm-up
        engine.add_request(fake_tokens(prompt_len, rng), SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        assert not engine.has_unfinished_requests(), "the prompt should compute in one step"
        linear = linear_pass(pairs)
        if index:
            prefills.append(took)
            linears.append(linear)
    prefill_med, linear_med = median(prefills), median(linears)
    return {"dtype": dtype, "prompt_len": prompt_len, "prefill_s": prefills, "linear_s": linears,
            "prefill_median_s": prefill_med, "linear_median_s": linear_med,
            "prompt_tokens_per_s": prompt_len / prefill_med, "linear_limit_tokens_per_s": prompt_len / linear_med,
            "fraction_of_linear_limit": linear_med / prefill_med, "target_met": linear_med / prefill_med >= 0.5}
