"""What glibc's malloc costs an engine stepping on a thread of its own, as every worker's engine does
(`cluster/worker/malloc_env.py`), with the settings workers start with and without them.

    python -m benchmarks.malloc_arenas                 # ~2 minutes on the 2-core box
    python -m benchmarks.malloc_arenas --prompts 32 --bursts 2

Each arm is a fresh process (glibc reads its settings once, at start) running the default model:
bursts of prompts (~128 tokens each, a few output tokens, greedy) on an engine thread, each burst
fresh prompts so nothing is cached. Per arm: the engine thread's page faults, its system and user CPU
seconds and the bursts' wall time (the first burst aside: the heap's first growth is paid with any
setting). The arms alternate, `--repeats` times. Writes benchmarks/results/malloc-arenas.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine, median, print_table, save
from cluster.worker.malloc_env import ENGINE_PROCESS_ENV, engine_process_env

ROOT = Path(__file__).resolve().parent.parent

# Run in the arm's own process: argv = prompts, bursts, output tokens, "thread" or "main".
ARM_SCRIPT = """
import json, resource, sys, threading, time
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine

prompts, bursts, max_tokens, where = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
engine = LLMEngine(EngineConfig(cache=CacheConfig(kv_cache_memory_gb=1.0)))
results = []

def run():
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # the warm-up, on the thread that steps
    for burst in range(bursts):
        for index in range(prompts):
            first = 10 + (burst * prompts + index) * 131
            engine.add_request([(first + i) % 40000 + 10 for i in range(128)],
                               SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        before, started = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += len(engine.step())
        after = resource.getrusage(resource.RUSAGE_THREAD)
        results.append({"faults": after.ru_minflt - before.ru_minflt, "sys_s": after.ru_stime - before.ru_stime,
                        "user_s": after.ru_utime - before.ru_utime, "wall_s": time.perf_counter() - started,
                        "tokens": tokens})

if where == "main":
    run()
else:
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
assert len(results) == bursts, "the bursts failed: see above"
print(json.dumps(results))
"""

ARMS = {
    "engine thread, glibc's defaults": ("thread", {}),
    "engine thread, the workers' settings": ("thread", engine_process_env()),
    "main thread, glibc's defaults (the engine alone)": ("main", {}),
}


def run_arm(where: str, settings: dict[str, str], args: argparse.Namespace) -> list[dict[str, float]]:
    env = {name: value for name, value in os.environ.items() if name not in ENGINE_PROCESS_ENV} | settings
    result = subprocess.run([sys.executable, "-c", ARM_SCRIPT, str(args.prompts), str(args.bursts),
                             str(args.max_tokens), where], cwd=ROOT, env=env, capture_output=True, text=True,
                            check=False)
    if result.returncode:
        raise RuntimeError(f"the arm failed:\n{result.stderr[-3000:]}")
    return list(json.loads(result.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per burst (default 64)")
    parser.add_argument("--bursts", type=int, default=3, help="bursts per arm, the first not counted (default 3)")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per prompt (default 4)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    info = machine("benchmarks.malloc_arenas")
    runs: dict[str, list[list[dict[str, float]]]] = {arm: [] for arm in ARMS}
    for _ in range(args.repeats):
        for arm, (where, settings) in ARMS.items():
            runs[arm].append(run_arm(where, settings, args))
    rows, summary = [], {}
    for arm, repeats in runs.items():
        counted = [burst for bursts in repeats for burst in bursts[1:]]
        summary[arm] = {key: median([burst[key] for burst in counted])
                        for key in ("faults", "sys_s", "user_s", "wall_s")}
        summary[arm]["tokens_per_s"] = median([burst["tokens"] / burst["wall_s"] for burst in counted])
        rows.append([arm, summary[arm]["faults"], summary[arm]["sys_s"], summary[arm]["user_s"],
                     summary[arm]["wall_s"], summary[arm]["tokens_per_s"]])
    print_table(f"{args.prompts} prompts a burst, medians of the bursts after the first",
                ["arm", "page faults", "system s", "user s", "wall s", "tokens/s"], rows)
    save("malloc-arenas", {"settings": engine_process_env(), "arguments": vars(args), "summary": summary,
                           "runs": runs}, info)


if __name__ == "__main__":
    main()
