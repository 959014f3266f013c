"""Whole-workload engine benchmarks (`benchmarks.engine`, `benchmarks.kv_cache_dtype`): batching policies,
preemption modes, and Hugging Face transformers, each arm a `cluster.bench.offline` run."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console

from cluster.bench.offline import BenchResult, Workload, run_workload, synthetic_workload
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.kv_cache_manager import cdiv
from cluster.engine.llm_engine import LLMEngine, RequestOutput

console = Console()
VOCAB_SIZE = 49152  # SmolLM2's; only bounds the synthetic prompt ids (which stay below 30000)


class Recorder:
    """Keeps, step by step, the running token count (for timelines) and each request's final tokens."""

    def __init__(self) -> None:
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self.outputs: dict[str, list[int]] = {}

    def __call__(self, elapsed: float, outputs: list[RequestOutput]) -> None:
        self.timeline.append((elapsed, self.timeline[-1][1] + len(outputs)))
        for output in outputs:
            if output.finished:
                self.outputs[output.request_id] = list(output.token_ids)


def run_arm(config: EngineConfig, workload: Workload, label: str) -> tuple[BenchResult, Recorder]:
    engine = LLMEngine(config)
    recorder = Recorder()
    result = run_workload(engine, workload, label, on_step=recorder)
    return result, recorder


def result_row(result: BenchResult, recorder: Recorder) -> dict[str, Any]:
    # The timeline is thinned to ~400 points: enough for a plot, small enough for a JSON file.
    stride = max(1, len(recorder.timeline) // 400)
    return {**result.as_dict(), "timeline": recorder.timeline[::stride] + recorder.timeline[-1:]}


# ---- 1: static vs continuous batching -----------------------------------------------------------

def static_vs_continuous(num_requests: int, max_num_seqs: int, kv_gb: float) -> dict[str, Any]:
    workload = synthetic_workload(num_requests, VOCAB_SIZE)
    arms = {}
    for batching in ("continuous", "static"):
        config = EngineConfig(cache=CacheConfig(kv_cache_memory_gb=kv_gb),
                              scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, batching=batching))
        result, recorder = run_arm(config, workload, batching)
        arms[batching] = result_row(result, recorder)
    ratio = arms["continuous"]["tokens_per_second"] / arms["static"]["tokens_per_second"]
    return {"num_requests": num_requests, "max_num_seqs": max_num_seqs, "kv_cache_memory_gb": kv_gb,
            "output_tokens": workload.num_output_tokens, "arms": arms, "throughput_ratio": ratio,
            "ttft_ratio_static_over_continuous": arms["static"]["mean_ttft_s"] / arms["continuous"]["mean_ttft_s"],
            "target": "continuous >= 3x static", "target_met": ratio >= 3}


# ---- 4: preemption by recompute vs swap ---------------------------------------------------------

def undersized_pool(workload: Workload, fraction: float, block_size: int = 16) -> int:
    """Blocks for about `fraction` of the requests at their full length, and never fewer than the
    largest request needs (it must fit alone)."""
    needs = [cdiv(len(p) + n, block_size) for p, n in zip(workload.prompts, workload.output_lengths, strict=True)]
    return max(int(sum(needs) * fraction), max(needs) + 1)


def compare_outputs(reference: dict[str, list[int]], other: dict[str, list[int]]) -> dict[str, Any]:
    differing = sorted(rid for rid in reference if other.get(rid) != reference[rid])
    first_divergence = {}
    for rid in differing:
        mine, theirs = reference[rid], other.get(rid, [])
        first_divergence[rid] = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                                     min(len(mine), len(theirs)))
    return {"identical": len(reference) - len(differing), "total": len(reference),
            "first_divergence_token": first_divergence}


def preemption(num_requests: int, fraction: float) -> dict[str, Any]:
    workload = synthetic_workload(num_requests, VOCAB_SIZE, seed=4)
    small = undersized_pool(workload, fraction)
    configs = {
        "no-preemption (2 GB pool)": EngineConfig(),
        "recompute": EngineConfig(cache=CacheConfig(num_blocks=small),
                                  scheduler=SchedulerConfig(preemption_mode="recompute")),
        "swap": EngineConfig(cache=CacheConfig(num_blocks=small), scheduler=SchedulerConfig(preemption_mode="swap")),
    }
    arms, outputs = {}, {}
    for label, config in configs.items():
        result, recorder = run_arm(config, workload, label)
        arms[label] = result_row(result, recorder)
        outputs[label] = recorder.outputs
    baseline = outputs["no-preemption (2 GB pool)"]
    for label in ("recompute", "swap"):
        arms[label]["greedy_vs_baseline"] = compare_outputs(baseline, outputs[label])
    identical = all(arms[label]["greedy_vs_baseline"]["identical"] == num_requests for label in ("recompute", "swap"))
    return {"num_requests": num_requests, "num_blocks_undersized": small, "pool_fraction": fraction,
            "output_tokens": workload.num_output_tokens, "arms": arms, "greedy_outputs_identical": identical}


# ---- 2: against Hugging Face transformers -------------------------------------------------------

def load_hf_model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32", attn_implementation="sdpa")
    return model.eval()


def hf_static(model: Any, workload: Workload, batch_size: int) -> dict[str, Any]:
    """transformers' `generate`, left-padded batches in workload order. Every row of a batch runs to
    the batch's longest max_new_tokens (min_new_tokens = that, so EOS never ends a row early); only
    each request's own max_new_tokens count as generated, the rest is padding work."""
    import torch
    from rich.progress import Progress

    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    useful = computed = 0
    outputs: dict[int, list[int]] = {}
    start = time.monotonic()
    with Progress() as bar, torch.inference_mode():
        task = bar.add_task(f"transformers generate, batches of {batch_size}", total=workload.num_output_tokens)
        for first in range(0, len(workload.prompts), batch_size):
            prompts = workload.prompts[first:first + batch_size]
            lengths = workload.output_lengths[first:first + batch_size]
            width, longest = max(map(len, prompts)), max(lengths)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=False, pad_token_id=pad)
            assert out.shape[1] == width + longest, "every row should run to the batch's longest output"
            for row, n in enumerate(lengths):
                outputs[first + row] = out[row, width:width + n].tolist()
            useful += sum(lengths)
            computed += len(prompts) * longest
            bar.advance(task, sum(lengths))
    seconds = time.monotonic() - start
    return {"seconds": seconds, "output_tokens": useful, "tokens_per_second": useful / seconds,
            "generated_incl_padding_work": computed, "outputs": outputs}


def hf_continuous(model: Any, workload: Workload, max_batch_tokens: int) -> dict[str, Any]:
    """transformers' continuous batching manager: one request per prompt with its own
    max_new_tokens, and eos_token_id=-1 (no EOS), the way its `add_requests` spells 'none'."""
    from rich.progress import Progress
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    longest = max(workload.output_lengths)
    hints = WorkloadHints(max_prompt_length=max(map(len, workload.prompts)), max_generated_length=longest,
                          num_requests=len(workload.prompts))
    # Pages of 256 tokens: enough for every request at once, so neither engine preempts.
    pages = sum(cdiv(len(p) + n, 256) for p, n in zip(workload.prompts, workload.output_lengths, strict=True))
    cb_config = ContinuousBatchingConfig(num_blocks=pages + 8, max_batch_tokens=max_batch_tokens,
                                         auto_switch_to_flash=False)
    generation = GenerationConfig(do_sample=False, max_new_tokens=longest)
    start = time.monotonic()
    results: dict[str, Any] = {}
    with model.continuous_batching_context_manager(generation_config=generation, continuous_batching_config=cb_config,
                                                   workload_hints=hints, block=True, timeout=5) as manager, \
            Progress() as bar:
        task = bar.add_task("transformers continuous batching", total=workload.num_output_tokens)
        for index, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lengths, strict=True)):
            manager.add_request(prompt, request_id=f"r{index}", max_new_tokens=n, eos_token_id=-1)
        while len(results) < len(workload.prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped early")
                continue
            if result.is_finished():
                results[result.request_id] = result
                bar.advance(task, len(result.generated_tokens))
    seconds = time.monotonic() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    errors = [r.error for r in results.values() if r.error]
    outputs = {int(rid[1:]): list(r.generated_tokens) for rid, r in results.items()}
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_second": tokens / seconds,
            "attn_implementation": model.config._attn_implementation, "errors": errors[:3], "outputs": outputs}


def vs_transformers(num_requests: int, batch_size: int) -> dict[str, Any]:
    import torch

    from cluster.model.device import resolve_dtype
    from cluster.weights.default_model import resolve_model_path

    workload = synthetic_workload(num_requests, VOCAB_SIZE, seed=2)
    config = EngineConfig(model=ModelConfig(dtype="float32"))
    result, recorder = run_arm(config, workload, "pdserve")
    ours = result_row(result, recorder)
    model = load_hf_model(str(resolve_model_path("default")))
    static = hf_static(model, workload, batch_size)
    continuous = hf_continuous(model, workload, config.scheduler.max_num_batched_tokens)
    reference = {f"request-{i}": tokens for i, tokens in static.pop("outputs").items()}
    cb_outputs = {f"request-{i}": tokens for i, tokens in continuous.pop("outputs").items()}
    expected = workload.num_output_tokens
    if continuous["output_tokens"] != expected:
        console.print(f"[yellow]transformers CB generated {continuous['output_tokens']} tokens, expected {expected}")
    # The engine in the dtype it picks for this CPU (bf16 where the CPU has bf16 matmuls), against
    # the same transformers runs (their default, fp32): what a user of each gets without asking.
    auto, auto_recorder = run_arm(EngineConfig(), workload, "pdserve, dtype auto")
    ours_auto = {**result_row(auto, auto_recorder), "dtype": resolve_dtype("auto", torch.device("cpu"))[0]}
    ratio = ours["tokens_per_second"] / continuous["tokens_per_second"]
    ratio_auto = ours_auto["tokens_per_second"] / continuous["tokens_per_second"]
    return {"num_requests": num_requests, "output_tokens": expected, "ours": ours, "ours_dtype_auto": ours_auto,
            "ratio_auto_vs_transformers_continuous": ratio_auto,
            "greedy_ours_auto_vs_hf_static": compare_outputs(reference, auto_recorder.outputs),
            "transformers_static": static, "transformers_continuous": continuous,
            "ratio_vs_transformers_continuous": ratio,
            "ratio_vs_transformers_static": ours["tokens_per_second"] / static["tokens_per_second"],
            "greedy_ours_vs_hf_static": compare_outputs(reference, recorder.outputs),
            "greedy_hf_cb_vs_hf_static": compare_outputs(reference, cb_outputs),
            "target": "ours (dtype auto) >= 5x transformers continuous batching", "target_met": ratio_auto >= 5}
