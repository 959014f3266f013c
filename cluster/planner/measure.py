"""`pdserve profile`: measure one engine in this process and fill a `Profile`.

Each point times real engine steps, the median of `repeats` runs:
- prefill (tokens t, context c): a request of c tokens first, so that its blocks sit in the prefix
  cache, then (each repeat) one of c + t tokens with the same first c: its one step computes exactly
  t tokens at context c (c is a multiple of the block size, as the prefix cache matches whole blocks);
- decode (batch b, context c): b requests of c-token prompts that share their first c - 1 tokens
  (computed once, then found in the prefix cache), then `decode_warmup` steps untimed and the
  median of the `decode_steps` after them, b rows each (the context grows by that many tokens
  meanwhile). Warm because a serving worker's steps are mostly far from a prompt, while the
  first ones after it may run slower (its activations in the CPU's caches, the allocator resizing).
  Shared blocks may sit warmer in the CPU's caches than b distinct contexts would: a small bias to
  fast at large b;
- transfer (n tokens): the worker's two ends of a KV transfer, `read_blocks` of n tokens' blocks
  and `write_blocks` of them back. The wire between two hosts is not in it (docs/planner.md).
Whatever threads torch uses here are the profile's `threads`: profile with those a worker will get.
"""

from __future__ import annotations

import itertools
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.planner.profile import Grid, Profile


@dataclass(frozen=True, slots=True)
class MeasureGrid:
    prefill_tokens: tuple[int, ...]
    prefill_contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    transfer_tokens: tuple[int, ...]
    repeats: int = 3
    decode_steps: int = 6
    decode_warmup: int = 3  # steps run untimed after the prompts, before the timed ones

    @property
    def num_points(self) -> int:
        return (len(self.prefill_tokens) * len(self.prefill_contexts)
                + len(self.decode_batches) * len(self.decode_contexts) + len(self.transfer_tokens))

    @property
    def max_tokens_held(self) -> int:
        return max(max(self.prefill_tokens) + max(self.prefill_contexts),
                   max(self.decode_batches) * (max(self.decode_contexts) + self.decode_warmup + self.decode_steps + 2),
                   max(self.transfer_tokens))


FULL = MeasureGrid(prefill_tokens=(16, 64, 256, 512, 1024, 2048), prefill_contexts=(0, 512, 1024),
                   decode_batches=(1, 4, 16, 32, 64), decode_contexts=(64, 512, 1024),
                   transfer_tokens=(16, 256, 1024, 4096), decode_steps=8)
QUICK = MeasureGrid(prefill_tokens=(8, 32, 64), prefill_contexts=(0, 64), decode_batches=(1, 4),
                    decode_contexts=(16, 64), transfer_tokens=(16, 64), repeats=1, decode_steps=2,
                    decode_warmup=1)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                            "torch": torch.__version__, "python": platform.python_version()}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
    except OSError:
        return info
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    info["cpu"] = fields.get("Model name", info["cpu"]).strip()
    info["flags"] = sorted(fields.get("Flags", "").split())
    return info


def engine_for(model: str, dtype: str, grid: MeasureGrid, block_size: int = 16) -> LLMEngine:
    """An engine that holds the largest point's KV, runs a whole prompt in one step, and caches prefixes."""
    blocks = -(-grid.max_tokens_held * 5 // 4 // block_size) + 16  # a quarter more: the prefixes stay cached
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=model, dtype=dtype),
        cache=CacheConfig(block_size=block_size, num_blocks=blocks, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(grid.prefill_tokens) + max(grid.prefill_contexts),
                                  max_num_seqs=max(grid.decode_batches))))


class Meter:
    """The timed experiments on one engine."""

    def __init__(self, engine: LLMEngine, grid: MeasureGrid, seed: int = 0) -> None:
        self.engine = engine
        self.grid = grid
        self.rng = random.Random(seed)
        vocab = engine.arch.vocab_size
        self.token_range = (min(3, vocab - 1), vocab - 1)  # past the special ids of the tiny models

    def tokens(self, count: int) -> list[int]:
        return [self.rng.randint(*self.token_range) for _ in range(count)]

    def run_out(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def prefill(self, tokens: int, context: int) -> float:
        """Every repeat shares one cached prefix of `context` tokens (computed once) and adds its own
        `tokens`; a repeat that found less of it cached would time more than it says: refused."""
        prefix = self.tokens(context)
        if context:
            self.engine.add_request(prefix, SamplingParams(max_tokens=1, ignore_eos=True))
            self.run_out()
        runs = []
        for _ in range(self.grid.repeats):
            request = self.engine.add_request(prefix + self.tokens(tokens), SamplingParams(max_tokens=1,
                                                                                         ignore_eos=True))
            started = time.perf_counter()
            self.engine.step()
            runs.append(time.perf_counter() - started)
            if request.num_cached_tokens != context:
                raise RuntimeError(f"the prefill point ({tokens} tokens at context {context}) found "
                                   f"{request.num_cached_tokens} tokens cached, not {context}")
            self.run_out()
        return statistics.median(runs)

    def decode(self, batch: int, context: int) -> float:
        """The median of `decode_steps` steps of one batch. Its prompts share all but their last token
        (cached once), so a point costs about `context` prompt tokens, not batch x context; each
        request still attends over its own `context` tokens of blocks, as a decode step does."""
        shared = self.tokens(context - 1)
        if len(shared) >= self.engine.config.cache.block_size:
            self.engine.add_request(shared, SamplingParams(max_tokens=1, ignore_eos=True))
            self.run_out()
        params = SamplingParams(max_tokens=self.grid.decode_warmup + self.grid.decode_steps + 1, ignore_eos=True)
        requests = [self.engine.add_request(shared + self.tokens(1), params) for _ in range(batch)]
        while any(not request.output_token_ids for request in requests):
            self.engine.step()
        seconds = steady_median(self.timed_step, self.grid.decode_warmup, self.grid.decode_steps)
        self.run_out()
        return seconds

    def timed_step(self) -> float:
        started = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - started

    def transfer(self, tokens: int) -> float:
        block_ids = list(range(-(-tokens // self.engine.config.cache.block_size)))
        runs = []
        for _ in range(self.grid.repeats):
            started = time.perf_counter()
            data = self.engine.runner.read_blocks(block_ids)
            self.engine.runner.write_blocks(block_ids, data)
            runs.append(time.perf_counter() - started)
        return statistics.median(runs)


def steady_median(step: Callable[[], float], warmup: int, count: int) -> float:
    """The median of `count` runs of `step` after `warmup` runs whose times are dropped: a steady
    state's time, not a cold start's."""
    for _ in range(warmup):
        step()
    return statistics.median(step() for _ in range(count))


@contextmanager
def progress_bar(show: bool, total: int) -> Iterator[Callable[[str], None]]:
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not show) as bar:
        task = bar.add_task("profiling", total=total)
        yield lambda label: bar.update(task, advance=1, description=label)


def measure(engine: LLMEngine, grid: MeasureGrid, show_progress: bool = True) -> Profile:
    meter = Meter(engine, grid)
    meter.prefill(grid.prefill_tokens[0], 0)  # warm-up: first calls allocate and pick kernels
    with progress_bar(show_progress, grid.num_points) as advance:
        prefill = _grid(grid.prefill_tokens, grid.prefill_contexts, meter.prefill, "prefill", advance)
        decode = _grid(grid.decode_batches, grid.decode_contexts, meter.decode, "decode", advance)
        transfer = []
        for tokens in grid.transfer_tokens:
            transfer.append(meter.transfer(tokens))
            advance(f"transfer {tokens} tokens")
    block_size = engine.config.cache.block_size
    one_block = engine.runner.read_blocks([0])
    kv_bytes_per_token = one_block.numel() * one_block.element_size() // block_size
    return Profile(prefill=prefill, decode=decode,
                   transfer_bytes=[tokens * kv_bytes_per_token for tokens in grid.transfer_tokens],
                   transfer_seconds=list(itertools.accumulate(transfer, max)),
                   kv_bytes_per_token=kv_bytes_per_token, block_size=block_size,
                   model=engine.model_name, dtype=str(engine.dtype).removeprefix("torch."),
                   threads=torch.get_num_threads(), machine=machine_info())


def _grid(rows: tuple[int, ...], columns: tuple[int, ...], point: Callable[[int, int], float], name: str,
          advance: Callable[[str], None]) -> Grid:
    seconds = []
    for row in rows:
        line = []
        for column in columns:
            line.append(point(row, column))
            advance(f"{name} {row} x {column}")
        seconds.append(line)
    return Grid(list(rows), list(columns), seconds).monotone()


def profile_model(model: str, dtype: str = "auto", quick: bool = False, show_progress: bool = True) -> Profile:
    """`model` as `pdserve serve` takes it; "tiny" builds the random-weight test model (seconds)."""
    grid = QUICK if quick else FULL
    if model != "tiny":
        return measure(engine_for(model, dtype, grid), grid, show_progress)
    from cluster.weights.synthetic import build_tiny_llama_checkpoint

    with tempfile.TemporaryDirectory(prefix="pdserve-profile-") as directory:
        path = build_tiny_llama_checkpoint(Path(directory) / "tiny")
        return measure(engine_for(str(path), dtype, grid), grid, show_progress)
