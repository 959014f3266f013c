"""Serving against the engine alone: where the throughput goes between them.

    python -m benchmarks.serve_threads                   # 64 requests at once, 2 repeats
    python -m benchmarks.serve_threads --requests 32 --repeats 1 --arms "engine alone" "1 prefill + 1 decode"
    python -m benchmarks.serve_threads --arms "engine alone" "1 prefill + 1 decode" "transformers continuous batching"

Arms on one workload (prompts ~128 tokens, outputs 64 tokens, EOS ignored, all sent at once), run in
alternating order so the machine's drift hits each alike, each one step further from the engine:
- `engine alone`: one `LLMEngine` in this process, stepped until done (torch's threads: all cores);
- `HTTP, engine in the gateway`: `pdserve serve --local` (the same engine behind the HTTP door):
  what the door, detokenizing and streaming cost;
- `cluster, 1 colocated worker`: `pdserve serve --mode colocated` with one worker on Ray: what the
  router and the hops across processes add (the same worker count as the engine alone);
- `1 prefill + 1 decode`: `make serve`'s layout, threads following the load (a busy worker computes
  on every core no other busy worker holds, `cluster.worker.node_cores`): what splitting the
  phases across two workers costs or gains on this machine;
- `1 prefill + 1 decode, 1 thread each` (only with `--arms`): OMP_NUM_THREADS=1, a fixed thread
  per worker instead of threads that follow the load;
- `transformers continuous batching` (only with `--arms`): the same requests through transformers'
  own continuous batching in this process, as `benchmarks.engine vs-transformers` runs it (its
  default dtype, fp32; every request given at once, EOS off): the peer serving is measured against
  (the target: `make serve` >= 3x it); `ratio_to_transformers_continuous` in the JSON when it ran;
- `engine alone, on all cores but one` and `cluster, 1 colocated worker, 1 core kept for the front
  door` (only with `--arms`): `reserved_cpus: 1` (`cluster.worker.cpu_binding`): the worker's engine
  on the cores but the first, the gateway, router, Ray and this process's load client on the first;
  the engine alone on the same cores. Their ratio is what serving costs when the front door does not
  take the engine's cores: `python -m benchmarks.serve_threads --arms "engine alone, on all cores
  but one" "cluster, 1 colocated worker, 1 core kept for the front door"`.
Every pdserve arm uses dtype auto. Output tokens per second of each, and each arm over the engine alone, go
to benchmarks/results/serve-threads.<machine>.<date>.json (`--name` changes the first part).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from typing import Any

from benchmarks.common import machine, print_table, save
from cluster.bench.server_runs import ServerSettings, measure, running_server
from cluster.bench.serving import LoadConfig
from cluster.bench.workloads import WorkloadConfig, build_workload
from cluster.worker.cpu_binding import bind_process, bind_thread, split_cpus
from cluster.worker.own_thread import in_own_thread

ARMS = ("engine alone", "HTTP, engine in the gateway", "cluster, 1 colocated worker", "1 prefill + 1 decode")
ALL_ARMS = (*ARMS, "1 prefill + 1 decode, 1 thread each", "transformers continuous batching",
            "engine alone, on all cores but one", "cluster, 1 colocated worker, 1 core kept for the front door")
RESERVED = 1  # the front door's cores in the last two arms


def engine_alone(workload: WorkloadConfig, cpus: frozenset[int] | None = None) -> float:
    """Output tokens per second of one engine given every request at once; on `cpus` (one thread
    each) when given, else on torch's threads (all cores). On a thread that ends, as a worker's
    engine thread: no OpenMP team of this process's other arms outlives it (`own_thread`)."""

    def bound() -> float:
        import torch

        if cpus is None:
            return _engine_alone(workload)
        bind_thread(cpus)
        default = torch.get_num_threads()
        torch.set_num_threads(len(cpus))
        try:
            return _engine_alone(workload)
        finally:  # part of the count is the process's (MKL's): an arm after this one must not run on these
            torch.set_num_threads(default)

    return in_own_thread(bound)


def _engine_alone(workload: WorkloadConfig) -> float:
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig
    from cluster.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(cache=CacheConfig(kv_cache_memory_gb=1.0)))
    requests = [conversation.turns[0] for conversation in build_workload(workload)]
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # warm-up, as the workers' own
    started = time.perf_counter()
    for request in requests:
        engine.add_request(request.prompt, SamplingParams(max_tokens=request.max_tokens, temperature=0,  # type: ignore[arg-type]
                                                          ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return sum(request.max_tokens for request in requests) / (time.perf_counter() - started)


def transformers_continuous(workload: WorkloadConfig) -> float:
    """Output tokens per second of transformers' continuous batching on the same requests (the
    default model, fp32), run as `benchmarks.engine vs-transformers` runs it."""
    from cluster.bench.engine_runs import hf_continuous, load_hf_model
    from cluster.bench.offline import Workload
    from cluster.engine.config import SchedulerConfig
    from cluster.weights.default_model import resolve_model_path

    requests = [conversation.turns[0] for conversation in build_workload(workload)]
    prompts = [[int(token) for token in request.prompt] for request in requests]  # token ids (synthetic workload)
    model = load_hf_model(str(resolve_model_path("default")))
    result = hf_continuous(model, Workload(prompts, [request.max_tokens for request in requests]),
                           SchedulerConfig().max_num_batched_tokens)
    if result["errors"]:
        raise RuntimeError(f"transformers continuous batching failed: {result['errors']}")
    return float(result["tokens_per_second"])


def served(workload: WorkloadConfig, settings: ServerSettings, reserved: int = 0) -> float:
    """Output tokens per second over HTTP. Admission by expected wait is off: the burst is the load
    measured, and a request refused early (429) would count as throughput not served. `reserved`:
    cores kept for the front door, this process's load client with it."""
    everywhere = frozenset(os.sched_getaffinity(0))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as config:
        config.write(f"max_prefill_wait_s: 0\nmax_decode_wait_s: 0\nreserved_cpus: {reserved}\n")
        config.flush()
        with running_server(replace(settings, config=config.name if settings.cluster else "")) as url:
            split = split_cpus(reserved)
            try:
                if split is not None:
                    bind_process(split.front_door)
                point = measure(url, workload, LoadConfig(warmup=1))
            finally:
                bind_process(everywhere)
    if point["failed"]:
        raise RuntimeError(f"{point['failed']} requests failed: the arms would not compare")
    return float(point["output_throughput"])


def run_arm(arm: str, workload: WorkloadConfig) -> float:
    settings = {
        ARMS[1]: ServerSettings(threads=0),
        ARMS[2]: ServerSettings(threads=0, cluster=True, colocated=True),
        ARMS[3]: ServerSettings(threads=0, cluster=True),
        ALL_ARMS[4]: ServerSettings(threads=1, cluster=True),
    }
    if arm == ARMS[0]:
        return engine_alone(workload)
    if arm == ALL_ARMS[5]:
        return transformers_continuous(workload)
    if arm == ALL_ARMS[6]:
        split = split_cpus(RESERVED)
        assert split is not None
        return engine_alone(workload, split.engines)
    if arm == ALL_ARMS[7]:
        return served(workload, ServerSettings(threads=0, cluster=True, colocated=True), RESERVED)
    return served(workload, settings[arm])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arms", nargs="+", choices=ALL_ARMS, default=list(ARMS),
                        help="the first is the baseline the others are divided by")
    parser.add_argument("--name", default="serve-threads",
                        help="the result file's first part (the machine and the date follow)")
    args = parser.parse_args(argv)
    info = machine("benchmarks.serve_threads")
    workload = WorkloadConfig(num_requests=args.requests, input_len=128, output_len=args.output_len,
                              output_sigma=0.0)
    runs: dict[str, list[float]] = {arm: [] for arm in args.arms}
    for repeat in range(args.repeats):
        for arm in args.arms if repeat % 2 == 0 else tuple(reversed(args.arms)):
            runs[arm].append(run_arm(arm, workload))
            print(f"{arm}: {runs[arm][-1]:.1f} output tokens/s")
    medians = {arm: statistics.median(values) for arm, values in runs.items()}
    alone = medians[args.arms[0]]
    rows = [[arm, value, value / alone] for arm, value in medians.items()]
    print_table(f"{args.requests} requests at once, {args.output_len} output tokens each (medians of {args.repeats})",
                ["arm", "output tok/s", f"/ {args.arms[0]}"], rows)
    data: dict[str, Any] = {"workload": {"requests": args.requests, "input_len": 128, "output_len": args.output_len},
                            "runs": runs, "median_tokens_per_s": medians,
                            "ratio_to_engine_alone": {arm: value / alone for arm, value in medians.items()}}
    if (peer := medians.get(ALL_ARMS[5])) is not None:  # the target: make serve (1P+1D) >= 3x this
        data["ratio_to_transformers_continuous"] = {arm: value / peer for arm, value in medians.items()}
        print_table("over transformers continuous batching (target for 1 prefill + 1 decode: >= 3x)",
                    ["arm", f"/ {ALL_ARMS[5]}"], [[arm, value / peer] for arm, value in medians.items()])
    save(args.name, data, info)


if __name__ == "__main__":
    main()
