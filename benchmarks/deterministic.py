"""What deterministic mode (`--deterministic`) costs: the same requests through one engine with it off and on,
alternated, in one run.

    python -m benchmarks.deterministic                       # the default model, dtype auto
    python -m benchmarks.deterministic --dtype float32 --repeats 3

Per arm: a batch of `--requests` prompts of `--prompt-tokens` random ids, each generating `--max-tokens`
tokens (greedy, EOS ignored): the wall time of the whole batch (prefill and decode), and a single
request's decode steps per second. The figure that travels between machines is each ratio of on to
off. Writes benchmarks/results/deterministic.<machine>.<date>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from benchmarks.common import RESULTS, machine, result_path
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.llm_engine import LLMEngine


def timed(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    started = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    engines = {on: LLMEngine(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype, deterministic=on),
                                          cache=CacheConfig(kv_cache_memory_gb=1.0)))
               for on in (False, True)}
    rng = np.random.default_rng(0)
    vocab = engines[False].arch.vocab_size
    prompts = [rng.integers(100, vocab - 100, args.prompt_tokens).tolist() for _ in range(args.requests)]
    batch = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for engine in engines.values():  # warm-up: first calls allocate and pick kernels
        timed(engine, prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    times: dict[str, list[float]] = {f"{kind} {arm}": [] for kind in ("batch_s", "single_s") for arm in ("off", "on")}
    for _ in range(args.repeats):
        for on, engine in engines.items():
            arm = "on" if on else "off"
            times[f"batch_s {arm}"].append(timed(engine, prompts, batch))
            times[f"single_s {arm}"].append(timed(engine, prompts[:1], batch))
            print(arm, {key: round(values[-1], 3) for key, values in times.items() if key.endswith(arm)}, flush=True)
    medians = {key: statistics.median(values) for key, values in times.items()}
    summary = {"machine": machine("benchmarks.deterministic"), "model": args.model,
               "dtype": engines[False].dtype, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
               "max_tokens": args.max_tokens, "times": times, "medians": medians,
               "batch_slowdown": medians["batch_s on"] / medians["batch_s off"],
               "single_slowdown": medians["single_s on"] / medians["single_s off"]}
    RESULTS.mkdir(exist_ok=True)
    result_path("deterministic").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("machine", "times")}, indent=2))


if __name__ == "__main__":
    main()
