"""What grammar masks cost: decode tokens/s of one batch with 0%, 50% and 100% of its rows constrained.

    python -m benchmarks.structured_outputs                  # JSON schema rows, 32 rows, 64 tokens each
    python -m benchmarks.structured_outputs --form regex --rows 8

Every row generates exactly `--tokens` tokens (free rows ignore EOS; constrained rows follow a grammar
that cannot end that soon), so each arm does the same model work and the difference is the masks:
filling them (llguidance, per constrained row) and applying them (torch, on the constrained rows).
The constrained arms run with the masks filled on a thread during the forward pass (`overlap`) and
without. Arms alternate, repeated, so that a busy machine slows them alike; besides tokens/s over
the whole decode, each arm reports its median step (and the tokens/s it gives), which a few stalls
of a shared machine do not move, and the median time to fill and to apply one step's masks.
Writes benchmarks/results/structured-outputs.<machine>.<date>.json, the CPU's flags (lscpu) included.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import torch  # noqa: E402

import cluster.model.grammar_masks as grammar_masks  # noqa: E402
import cluster.model.sampler as sampler  # noqa: E402
from benchmarks.common import machine, median, print_table, save  # noqa: E402
from cluster.common.sampling_params import SamplingParams  # noqa: E402
from cluster.common.structured_output import StructuredOutput  # noqa: E402
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cluster.engine.llm_engine import LLMEngine  # noqa: E402
from cluster.model.grammar_masks import GrammarMasker  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
    "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3}},
    "required": ["name", "age", "email", "tags"], "additionalProperties": False}
# Neither can end within the tokens measured: every constrained row runs as long as a free one.
FORMS = {
    "json": StructuredOutput("json", json.dumps({"type": "array", "items": PERSON, "minItems": 1000})),
    "regex": StructuredOutput("regex", "([A-Z][a-z]+ ){1000}"),
}
PROMPT = "List the people of a small company as JSON: name, age, email and tags of each."
MS = 1e3


def cpu_flags() -> str:
    """The CPU's feature flags as lscpu prints them (what vector units torch and llguidance may use)."""
    try:
        output = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in output.splitlines() if line.startswith("Flags:")),
                "unknown")


def make_engine(rows: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(), cache=CacheConfig(kv_cache_memory_gb=0.5),
                                  scheduler=SchedulerConfig(max_num_seqs=rows)))


class Durations:
    """Every call's seconds, per name: medians shrug off the moments a busy machine stalls us."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        calls = self.calls.setdefault(name, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                calls.append(time.perf_counter() - started)

        return timed

    def take(self) -> dict[str, list[float]]:
        taken = {name: list(calls) for name, calls in self.calls.items()}
        for calls in self.calls.values():
            calls.clear()
        return taken


def run_arm(engine: LLMEngine, rows: int, constrained: int, structured: StructuredOutput, tokens: int,
            durations: Durations) -> dict[str, Any]:
    """One batch to its end; the decode steps' times (the prefill is not measured)."""
    prompt = engine.chat_prompt([{"role": "user", "content": PROMPT}])
    free = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for row in range(rows):
        params = SamplingParams(max_tokens=tokens, temperature=0, structured=structured) if row < constrained \
            else free
        engine.add_request(prompt, params)
    while any(not request.output_token_ids for request in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prefill, and the first tokens
    durations.take()
    steps: list[float] = []
    outputs = 0
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs += len(engine.step())
        steps.append(time.perf_counter() - started)
    parts = durations.take()
    return {"constrained_rows": constrained, "decode_tokens": outputs, "seconds": sum(steps),
            "tokens_per_second": outputs / sum(steps), "step_median_s": median(steps),
            "steady_tokens_per_second": rows / median(steps),
            "mask_fill_median_s": median(parts.get("fill", [])), "mask_apply_median_s": median(parts.get("apply", []))}


def timed(durations: Durations) -> None:
    """Time the masks where the engine computes and applies them."""
    grammar_masks.fill_grammar_masks = durations.wrap("fill", grammar_masks.fill_grammar_masks)  # type: ignore[assignment]
    sampler.apply_grammar_masks = durations.wrap("apply", sampler.apply_grammar_masks)  # type: ignore[assignment]


def benchmark(form: str, rows: int, tokens: int, repeats: int) -> dict[str, Any]:
    engine = make_engine(rows)
    structured = FORMS[form]
    started = time.perf_counter()
    engine.grammars.check(structured)  # the vocabulary's view for llguidance, then this grammar
    setup_s = time.perf_counter() - started
    durations = Durations()
    timed(durations)
    # "0% again" measures nothing new: how far two identical arms drift apart on this machine.
    arms = {"0%": (0, True), "50%": (rows // 2, True), "50% no overlap": (rows // 2, False),
            "100%": (rows, True), "100% no overlap": (rows, False), "0% again": (0, True)}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    run_arm(engine, rows, rows, structured, 4, durations)  # warm: the first steps of a grammar build its caches
    for _ in range(repeats):
        for name, (constrained, overlap) in arms.items():
            engine.runner.grammar_masker = GrammarMasker(overlap)
            runs[name].append(run_arm(engine, rows, constrained, structured, tokens, durations))
    summary = {name: summarize(arm_runs) for name, arm_runs in runs.items()}
    for key in ("tokens_per_second", "steady_tokens_per_second"):
        base = summary["0%"][key]
        for arm in summary.values():
            arm[f"{key}_vs_unconstrained"] = arm[key] / base
    return {"form": form, "spec": structured.spec, "rows": rows, "tokens_per_row": tokens, "repeats": repeats,
            "setup_and_first_compile_s": setup_s, "arms": summary, "runs": runs}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("tokens_per_second", "steady_tokens_per_second", "step_median_s", "mask_fill_median_s",
            "mask_apply_median_s")
    medians = {key: median([run[key] for run in runs]) for key in keys}
    return {"constrained_rows": runs[0]["constrained_rows"], **medians}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured_outputs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--form", choices=sorted(FORMS), nargs="+", default=["json"])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="generated per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = {**machine("benchmarks.structured_outputs"), "cpu_flags": cpu_flags()}
    results = [benchmark(form, args.rows, args.tokens, args.repeats) for form in args.form]
    for result in results:
        print_table(f"{result['form']}: {result['rows']} rows x {result['tokens_per_row']} tokens, medians of "
                    f"{result['repeats']} (setup + first compile {result['setup_and_first_compile_s'] * MS:.0f} ms)",
                    ["constrained", "tok/s", "vs 0%", "median step ms", "tok/s at median step", "vs 0%",
                     "mask fill ms", "mask apply ms"],
                    [[name, arm["tokens_per_second"], arm["tokens_per_second_vs_unconstrained"],
                      arm["step_median_s"] * MS, arm["steady_tokens_per_second"],
                      arm["steady_tokens_per_second_vs_unconstrained"], arm["mask_fill_median_s"] * MS,
                      arm["mask_apply_median_s"] * MS] for name, arm in result["arms"].items()])
    save("structured-outputs", {"results": results}, info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
