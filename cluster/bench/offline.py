"""Offline engine benchmarks: a synthetic workload pushed through `LLMEngine.step()`.

All requests arrive at once; throughput counts generated tokens, TTFT is measured from arrival.
`benchmarks/engine.py` builds its comparisons from these pieces; `pdserve bench` runs one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cluster.common.sampling_params import SamplingParams
from cluster.engine.llm_engine import LLMEngine, RequestOutput


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    output_lengths: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lengths)


def synthetic_workload(num_requests: int, vocab_size: int, seed: int = 0, prompt_range: tuple[int, int] = (16, 256),
                       output_median: int = 64, output_sigma: float = 0.8, output_cap: int = 512) -> Workload:
    """Uniform prompt lengths; lognormal output lengths (heavy tail) capped at `output_cap`."""
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(prompt_range[0], prompt_range[1] + 1, num_requests)
    outputs = np.clip(np.round(rng.lognormal(np.log(output_median), output_sigma, num_requests)), 1, output_cap)
    # Ids from the middle of the vocabulary: real tokens, no special ones.
    prompts = [rng.integers(1000, min(vocab_size, 30000), n).tolist() for n in prompt_lengths]
    return Workload(prompts, [int(n) for n in outputs])


@dataclass(slots=True)
class BenchResult:
    label: str
    num_requests: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    mean_ttft_s: float
    p50_ttft_s: float
    num_steps: int
    num_preemptions: int

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


# Called after every step with the seconds since the start and that step's outputs.
StepCallback = Callable[[float, list[RequestOutput]], None]


def run_workload(engine: LLMEngine, workload: Workload, label: str, progress: bool = True,
                 on_step: StepCallback | None = None) -> BenchResult:
    """Run every request to its fixed length (EOS ignored); counts only what the engine generated.

    `on_step` lets a benchmark keep a timeline or the outputs without a second copy of this loop."""
    start = time.monotonic()
    for prompt, length in zip(workload.prompts, workload.output_lengths, strict=True):
        engine.add_request(prompt, SamplingParams(max_tokens=length, temperature=0, ignore_eos=True))
    preemptions_before = engine.scheduler.num_preemptions
    ttfts: list[float] = []
    tokens = steps = 0
    with _progress(progress) as bar:
        task = bar.add_task(label, total=workload.num_output_tokens)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            tokens += len(outputs)
            ttfts += [o.first_token_time - start for o in outputs if len(o.token_ids) == 1 and o.first_token_time]
            bar.update(task, advance=len(outputs))
            if on_step is not None:
                on_step(time.monotonic() - start, outputs)
    seconds = time.monotonic() - start
    return BenchResult(label, len(workload.prompts), tokens, seconds, tokens / seconds, statistics.fmean(ttfts),
                       statistics.median(ttfts), steps, engine.scheduler.num_preemptions - preemptions_before)


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                    TimeElapsedColumn(), disable=not enabled)
