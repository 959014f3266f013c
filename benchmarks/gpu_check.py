"""The GPU check: the engine on one CUDA device, in one command that needs only torch, triton,
transformers, tokenizers, safetensors, jinja2, pyyaml, numpy and rich besides the working tree.

    python -m benchmarks.gpu_check --out DIR [--minutes 8]    # Llama-3-8B's shape, random bf16 weights
    python -m benchmarks.gpu_check --dry-run --out DIR        # the same code on the CPU, tiny shapes

The model is built on the device in bf16 from random weights (`cluster.weights.synthetic.random_checkpoint`:
no file, no float32 copy) and served by `LLMEngine`, so every figure is the engine's own step:

  device       device-to-device copy bandwidth, and an 8192^3 bf16 matmul: the roofline's two peaks
  correctness  the Triton backend against the torch backend (greedy tokens, logits), CUDA-graph replays
               against eager decode steps, on the same random model
  decode       engine steps at batch 1, 32 and 256: tokens/s, ms/step, and the fraction of the HBM
               roofline (weights + KV read per step / the measured copy bandwidth)
  prefill      prefill tokens/s as MFU (2 x matmul parameters per token) against the measured matmul
               and the datasheet peak
  cuda_graphs  decode at batch 1 and 32 with CUDA graphs on and off
  kv_copy      the KV blocks' device copies that transfers use (`read_blocks` gathers, `write_blocks` scatters)
  memory       torch's peak allocated and reserved bytes after loading and after the runs

Each section runs in its own try/except with its share of the time, and the results are written after
every section, so a failure or a cut-off run keeps what was measured. Writes DIR/gpu-check.json and
DIR/gpu-check.md; without --out, benchmarks/results/gpu-check-<gpu>.<machine>.<date>.json and .md.
Exits 2 without a CUDA device (unless --dry-run), 1 when a section failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}
TINY = LLAMA_3_8B | {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024}
# Dense bf16 tensor-core FLOP/s and HBM bytes/s from NVIDIA's datasheets; the first name found in the GPU's wins.
DATASHEETS = (("H200", 989e12, 4.8e12), ("H100 NVL", 835e12, 3.9e12), ("H100 PCIe", 756e12, 2.0e12),
              ("H100", 989e12, 3.35e12))
SHARES = {"device": 0.05, "correctness": 0.3, "decode": 0.25, "prefill": 0.1, "cuda_graphs": 0.15,
          "kv_copy": 0.05, "memory": 0.01}
# Figures the JSON keeps but the summary table leaves out: sizes and inputs rather than results.
DETAILS = {"traceback", "copy_bytes", "matmul_size", "weight_bytes", "kv_bytes", "steps_compared", "logits_max_abs",
           "matmul_params", "prompts", "tokens", "prompt_len", "steps", "bytes", "blocks", "captured_buckets"}
WARM_STEPS = 3  # decode steps before timing: they compile the kernels and capture the bucket's graph


@dataclass(frozen=True, slots=True)
class Plan:
    """The sizes of one run."""

    model: dict[str, Any]
    device: str
    decode_batches: tuple[int, ...] = (1, 32, 256)
    graph_batches: tuple[int, ...] = (1, 32)
    prompt_len: int = 512
    decode_steps: int = 32
    prefill_prompts: int = 4
    prefill_len: int = 2048  # 4 x 2048: one engine step of 8192 tokens
    correctness_prompts: int = 4
    correctness_tokens: int = 16
    matmul_size: int = 8192
    copy_bytes: int = 1 << 30
    kv_copy_blocks: int = 512
    block_size: int = 16
    max_model_len: int = 4096
    max_batched_tokens: int = 8192

    @property
    def prefill_steps(self) -> int:
        """At most this many steps prefill the largest batch; its first sequences decode meanwhile."""
        return -(-max(self.decode_batches) * self.prompt_len // self.max_batched_tokens) + 1

    @property
    def num_blocks(self) -> int:
        grown = self.prompt_len + self.prefill_steps + WARM_STEPS + self.decode_steps + 2
        per_request = -(-grown // self.block_size)
        prefill = self.prefill_prompts * -(-(self.prefill_len + 1) // self.block_size)
        return max(max(self.decode_batches) * per_request, prefill, self.kv_copy_blocks) + 16


FULL = Plan(model=LLAMA_3_8B, device="cuda")
DRY = Plan(model=TINY, device="cpu", decode_batches=(1, 4, 8), graph_batches=(1, 4), prompt_len=24, decode_steps=3,
           prefill_prompts=2, prefill_len=32, correctness_prompts=2, correctness_tokens=4, matmul_size=128,
           copy_bytes=1 << 22, kv_copy_blocks=8, max_model_len=256, max_batched_tokens=64)


@dataclass(slots=True)
class Report:
    """Every figure of the run, written out after each section."""

    out: Path | None
    machine: dict[str, Any]
    sections: dict[str, Any] = field(default_factory=dict)

    def write(self) -> list[Path]:
        from benchmarks.common import gpu_slug, result_path

        document = {"benchmark": "gpu-check", "machine": self.machine, **self.sections}
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            paths = [self.out / "gpu-check.json", self.out / "gpu-check.md"]
        else:
            name = f"gpu-check-{gpu_slug(self.machine['gpu'])}"
            paths = [result_path(name), result_path(name, ".md")]
            paths[0].parent.mkdir(parents=True, exist_ok=True)
        paths[0].write_text(json.dumps(document, indent=1, default=str) + "\n")
        paths[1].write_text(markdown(document))
        return paths


# ---- the device ---------------------------------------------------------------------------------------

def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def seconds_per_call(function: Callable[[], Any], device: str, calls: int = 10, repeats: int = 5) -> float:
    """The median over `repeats` of the mean time of `calls` calls, after one call of warm-up."""
    function()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(calls):
            function()
        synchronize(device)
        samples.append((time.perf_counter() - started) / calls)
    return statistics.median(samples)


def machine_info(device: str) -> dict[str, Any]:
    import torch
    import triton

    info: dict[str, Any] = {"gpu": "cpu", "torch": torch.__version__, "triton": triton.__version__,
                            "cuda": torch.version.cuda, "python": platform.python_version(),
                            "host": platform.node(), "command": " ".join(["python -m benchmarks.gpu_check",
                                                                          *sys.argv[1:]])}
    if device.startswith("cuda"):
        properties = torch.cuda.get_device_properties(0)
        info |= {"gpu": properties.name, "memory_gb": properties.total_memory / 1e9,
                 "sms": properties.multi_processor_count, "capability": f"{properties.major}.{properties.minor}",
                 "driver": nvidia_driver()}
    return info


def nvidia_driver() -> str:
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"
    return result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else "unknown"


def datasheet(gpu: str) -> tuple[float, float] | None:
    """(bf16 FLOP/s, HBM bytes/s) of the datasheet, where the GPU is one listed."""
    return next(((flops, bandwidth) for name, flops, bandwidth in DATASHEETS if name in gpu), None)


def measure_device(plan: Plan, gpu: str) -> dict[str, Any]:
    """The copy bandwidth (bytes read + written per second) and the bf16 matmul FLOP/s of this device."""
    sheet = datasheet(gpu)
    return {"copy_bytes": plan.copy_bytes, "copy_bandwidth_gbs": copy_bandwidth(plan.copy_bytes, plan.device) / 1e9,
            "matmul_size": plan.matmul_size, "matmul_tflops": matmul_flops(plan.matmul_size, plan.device) / 1e12,
            "datasheet_tflops": sheet[0] / 1e12 if sheet else None,
            "datasheet_bandwidth_gbs": sheet[1] / 1e9 if sheet else None}


def copy_bandwidth(size: int, device: str) -> float:
    """Bytes read plus written per second by a device-to-device copy of `size` bytes."""
    import torch

    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * size / seconds_per_call(lambda: target.copy_(source), device)


def matmul_flops(n: int, device: str) -> float:
    """FLOP/s of an n x n by n x n bf16 matmul."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / seconds_per_call(lambda: a @ b, device, calls=5, repeats=3)


# ---- the engine ---------------------------------------------------------------------------------------

def build_engine(plan: Plan, backend: str, seed: int = 0) -> Any:
    """An engine over the random model; the same seed gives the same weights for every backend."""
    import torch

    from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from cluster.engine.llm_engine import LLMEngine
    from cluster.weights.synthetic import random_checkpoint

    checkpoint = random_checkpoint(plan.model, device=plan.device, dtype=torch.bfloat16, seed=seed)
    config = EngineConfig(
        model=ModelConfig(model="random-llama", dtype="bfloat16", device=plan.device, max_model_len=plan.max_model_len),
        cache=CacheConfig(block_size=plan.block_size, num_blocks=plan.num_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=plan.max_batched_tokens, max_num_seqs=256),
        attention_backend=backend)
    return LLMEngine(config, checkpoint=checkpoint)


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (count, length), generator=generator).tolist()


class LogitsRecorder:
    """Keeps the logits of every step's sampled rows (float32, on the device) as the runner computes them."""

    def __init__(self, engine: Any) -> None:
        self.steps: list[Any] = []
        self.model = engine.runner.model
        self.compute_logits = self.model.compute_logits
        self.model.compute_logits = self

    def __call__(self, hidden: Any, upcast: bool = True) -> Any:
        logits = self.compute_logits(hidden, upcast)
        self.steps.append(logits.float().clone())
        return logits

    def close(self) -> None:
        self.model.compute_logits = self.compute_logits


def greedy_run(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[Any]]:
    """Greedy tokens of every prompt, batched, and the logits of each step."""
    from cluster.common.sampling_params import SamplingParams

    recorder = LogitsRecorder(engine)
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finally:
        recorder.close()
    return [list(output.token_ids) for output in outputs], recorder.steps


def compare_runs(expected: tuple[list[list[int]], list[Any]], actual: tuple[list[list[int]], list[Any]]) -> dict:
    """Tokens equal, and the logits' largest difference over the steps before the first token that
    differs (from there on the two runs see different inputs)."""
    (tokens, logits), (other_tokens, other_logits) = expected, actual
    diverged = next((step for step in range(len(tokens[0]))
                     if [ids[step] for ids in tokens] != [ids[step] for ids in other_tokens]), None)
    compared = logits[:diverged + 1] if diverged is not None else logits
    max_diff = max((float((a - b).abs().max()) for a, b in zip(compared, other_logits, strict=False)), default=0.0)
    scale = max((float(a.abs().max()) for a in compared), default=0.0)
    return {"tokens_equal": tokens == other_tokens, "first_divergent_step": diverged,
            "logits_max_abs_diff": max_diff, "logits_max_abs": scale, "steps_compared": len(compared)}


def reference_run(plan: Plan, prompts: list[list[int]]) -> tuple[list[list[int]], list[Any]]:
    """Greedy tokens and logits with the torch backend; its engine is gone when this returns."""
    return greedy_run(build_engine(plan, "torch"), prompts, plan.correctness_tokens)


def release_memory() -> None:
    """Hand what dropped engines held back to the device, before the next engine is built."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak_memory(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


# ---- sections -----------------------------------------------------------------------------------------

@dataclass(slots=True)
class Run:
    """What the sections share: the plan, the deadline of the running section, the engine and the peaks."""

    plan: Plan
    gpu: str
    deadline: float = 0.0
    engine: Any = None
    device: dict[str, Any] = field(default_factory=dict)
    memory_after_load: dict[str, Any] = field(default_factory=dict)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def triton_engine(self) -> Any:
        """The engine every section after the reference run measures, built once; the device's peak
        memory counts from its build."""
        if self.engine is None:
            reset_peak_memory(self.plan.device)
            self.engine = build_engine(self.plan, "triton")
            self.memory_after_load = memory_now(self.plan.device)
        return self.engine


def section_device(run: Run) -> dict[str, Any]:
    run.device = measure_device(run.plan, run.gpu)
    return run.device


def section_correctness(run: Run) -> dict[str, Any]:
    plan = run.plan
    prompts = random_prompts(plan.correctness_prompts, 40, plan.model["vocab_size"], seed=1)
    prompts = [prompt[:8 + 9 * index] for index, prompt in enumerate(prompts)]  # lengths 8, 17, 26, ...
    reference = reference_run(plan, prompts)
    release_memory()
    engine = run.triton_engine()
    graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None
    eager = greedy_run(engine, prompts, plan.correctness_tokens)
    engine.runner.decode_graphs = graphs
    result: dict[str, Any] = {"prompts": len(prompts), "tokens": plan.correctness_tokens,
                              "triton_vs_torch": compare_runs(reference, eager)}
    if graphs is None:
        result["graphs_vs_eager"] = {"skipped": f"no CUDA graphs on {plan.device}"}
    elif run.out_of_time():
        result["graphs_vs_eager"] = {"skipped": "out of time"}
    else:
        result["graphs_vs_eager"] = compare_runs(eager, greedy_run(engine, prompts, plan.correctness_tokens))
    return result


def decoding(engine: Any) -> bool:
    """Every request has its prompt computed: the next step is a decode-only step."""
    scheduler = engine.scheduler
    return not scheduler.waiting and all(r.num_tokens - r.num_computed_tokens == 1 for r in scheduler.running)


def decode_rate(run: Run, engine: Any, batch: int) -> dict[str, Any]:
    """Times `decode_steps` engine steps of `batch` sequences of `prompt_len` tokens, after the prefill and
    WARM_STEPS; then the roofline: the bytes a step must read over the measured copy bandwidth."""
    from cluster.common.sampling_params import SamplingParams

    plan = run.plan
    # No sequence may finish while timed: the batch stays whole (the abort below ends them all).
    params = SamplingParams(max_tokens=plan.prefill_steps + WARM_STEPS + plan.decode_steps + 2, temperature=0,
                            ignore_eos=True)
    ids = [engine.add_request(prompt, params).request_id
           for prompt in random_prompts(batch, plan.prompt_len, plan.model["vocab_size"], seed=batch)]
    try:
        while not decoding(engine):
            engine.step()
        for _ in range(WARM_STEPS):
            engine.step()
        tokens_before = sum(request.num_tokens for request in engine.scheduler.running)
        synchronize(plan.device)
        started = time.perf_counter()
        produced = sum(len(output.new_token_ids) for _ in range(plan.decode_steps) for output in engine.step())
        synchronize(plan.device)
        seconds = (time.perf_counter() - started) / plan.decode_steps
        tokens_after = sum(request.num_tokens for request in engine.scheduler.running)
    finally:
        for request_id in ids:
            engine.abort(request_id)
    kv_tokens = (tokens_before + tokens_after) / 2  # every sequence's context, over the timed steps
    return {"batch": batch, "ms_per_step": seconds * 1e3, "tokens_per_s": produced / plan.decode_steps / seconds,
            "mean_context": kv_tokens / batch, **roofline(run, engine, kv_tokens, seconds)}


def roofline(run: Run, engine: Any, kv_tokens: float, seconds: float) -> dict[str, Any]:
    """A decode step reads every weight once (of the embedding, only the batch's rows) and the KV of
    `kv_tokens` tokens."""
    model, arch = engine.runner.model, engine.arch
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not arch.tie_word_embeddings:
        weight_bytes -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    kv_bytes = kv_tokens * kv_bytes_per_token(engine)
    bandwidth = run.device.get("copy_bandwidth_gbs", 0.0) * 1e9
    floor = (weight_bytes + kv_bytes) / bandwidth if bandwidth else None
    return {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "roofline_ms": floor * 1e3 if floor else None,
            "fraction_of_roofline": floor / seconds if floor else None}


def kv_bytes_per_token(engine: Any) -> int:
    cache = engine.runner.kv_caches[0]
    return len(engine.runner.kv_caches) * 2 * cache.shape[3] * cache.shape[4] * cache.element_size()


def section_decode(run: Run) -> dict[str, Any]:
    engine = run.triton_engine()
    rows = [{"batch": batch, "skipped": "out of time"} if run.out_of_time() else decode_rate(run, engine, batch)
            for batch in run.plan.decode_batches]
    return {"prompt_len": run.plan.prompt_len, "steps": run.plan.decode_steps,
            "graphs": engine.runner.decode_graphs is not None, "rows": rows}


def section_prefill(run: Run) -> dict[str, Any]:
    from cluster.common.sampling_params import SamplingParams

    plan, engine = run.plan, run.triton_engine()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for seed in (0, 1):  # the first round compiles the prefill kernels: the second is timed
        prompts = random_prompts(plan.prefill_prompts, plan.prefill_len, plan.model["vocab_size"], seed=100 + seed)
        synchronize(plan.device)
        started = time.perf_counter()
        engine.generate(prompts, params)
        synchronize(plan.device)
        times.append(time.perf_counter() - started)
    tokens = plan.prefill_prompts * plan.prefill_len
    return {"prompts": plan.prefill_prompts, "prompt_len": plan.prefill_len, "seconds": times[-1],
            "tokens_per_s": tokens / times[-1], **mfu(run, engine, tokens / times[-1])}


def mfu(run: Run, engine: Any, tokens_per_s: float) -> dict[str, Any]:
    """Model FLOPs utilisation: 2 FLOPs per matmul parameter per token (the embedding is a lookup, and
    the lm head runs on one row per prompt); the causal attention's FLOPs reported beside it."""
    arch = engine.arch
    matmul_params = sum(p.numel() for name, p in engine.runner.model.named_parameters()
                        if "embed_tokens" not in name and "lm_head" not in name and p.dim() == 2)
    attention = 2 * arch.num_layers * arch.num_heads * arch.head_dim * run.plan.prefill_len  # per token, causal
    flops = tokens_per_s * 2 * matmul_params
    measured = run.device.get("matmul_tflops", 0.0) * 1e12
    sheet = datasheet(run.gpu)
    return {"matmul_params": matmul_params, "tflops": flops / 1e12,
            "tflops_with_attention": tokens_per_s * (2 * matmul_params + attention) / 1e12,
            "mfu_of_measured_matmul": flops / measured if measured else None,
            "mfu_of_datasheet": flops / sheet[0] if sheet else None}


def section_cuda_graphs(run: Run) -> dict[str, Any]:
    engine = run.triton_engine()
    graphs = engine.runner.decode_graphs
    if graphs is None:
        return {"skipped": f"no CUDA graphs on {run.plan.device} (CUDA with the Triton backend only)"}
    rows = []
    try:
        for batch in run.plan.graph_batches:
            if run.out_of_time():
                rows.append({"batch": batch, "skipped": "out of time"})
                continue
            engine.runner.decode_graphs = None
            eager = decode_rate(run, engine, batch)
            engine.runner.decode_graphs = graphs
            replayed = decode_rate(run, engine, batch)
            rows.append({"batch": batch, "eager_ms": eager["ms_per_step"], "graphs_ms": replayed["ms_per_step"],
                         "speedup": eager["ms_per_step"] / replayed["ms_per_step"]})
    finally:
        engine.runner.decode_graphs = graphs
    return {"rows": rows, "captured_buckets": sorted(graphs.graphs), "enabled": graphs.enabled}


def section_kv_copy(run: Run) -> dict[str, Any]:
    """The gather of scattered blocks into one transfer frame, and its scatter back, on the device."""
    import torch

    engine = run.triton_engine()
    generator = torch.Generator().manual_seed(7)
    block_ids = torch.randperm(engine.num_blocks, generator=generator)[:run.plan.kv_copy_blocks].tolist()
    frame = engine.runner.read_blocks(block_ids)
    gather = seconds_per_call(lambda: engine.runner.read_blocks(block_ids), run.plan.device, calls=3)
    scatter = seconds_per_call(lambda: engine.runner.write_blocks(block_ids, frame), run.plan.device, calls=3)
    payload = frame.numel() * frame.element_size()
    copy = run.device.get("copy_bandwidth_gbs", 0.0)
    return {"blocks": len(block_ids), "bytes": payload, "gather_gbs": payload / gather / 1e9,
            "scatter_gbs": payload / scatter / 1e9,
            # a copy reads and writes each byte: compared as such with the device copy
            "gather_fraction_of_copy": 2 * payload / gather / 1e9 / copy if copy else None,
            "scatter_fraction_of_copy": 2 * payload / scatter / 1e9 / copy if copy else None}


def memory_now(device: str) -> dict[str, Any]:
    import torch

    if not device.startswith("cuda"):
        return {"skipped": "torch counts device memory on CUDA only"}
    return {"allocated_gb": torch.cuda.memory_allocated() / 1e9, "reserved_gb": torch.cuda.memory_reserved() / 1e9,
            "max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
            "max_reserved_gb": torch.cuda.max_memory_reserved() / 1e9}


SECTIONS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "device": section_device, "correctness": section_correctness, "decode": section_decode,
    "prefill": section_prefill, "cuda_graphs": section_cuda_graphs, "kv_copy": section_kv_copy,
    "memory": lambda run: {"after_load": run.memory_after_load, "after_runs": memory_now(run.plan.device)},
}


def run_section(run: Run, report: Report, name: str, budget_s: float) -> bool:
    """One section under its deadline; its figures or its error go into the report, which is written."""
    started = time.monotonic()
    run.deadline = started + SHARES[name] * budget_s
    print(f"== {name}", flush=True)
    try:
        result = SECTIONS[name](run)
        ok = True
    except Exception as error:  # one failure must not lose the other sections
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
        ok = False
    result["seconds"] = round(time.monotonic() - started, 2)
    report.sections[name] = result
    print(json.dumps(result, default=str)[:2000], flush=True)
    report.write()
    return ok


# ---- the summary table --------------------------------------------------------------------------------

def markdown(document: dict[str, Any]) -> str:
    machine = document["machine"]
    lines = [f"# GPU check: {machine['gpu']}", "",
             f"torch {machine['torch']}, triton {machine['triton']}, CUDA {machine['cuda']}, "
             f"driver {machine.get('driver', '-')}; `{machine['command']}`", "", "| section | figure | value |",
             "|---|---|---|"]
    for section, content in document.items():
        if section in ("benchmark", "machine") or not isinstance(content, dict):
            continue
        for key, value in flatten(content):
            if key.rsplit(".", 1)[-1] not in DETAILS:
                lines.append(f"| {section} | {key} | {format_value(value)} |")
    return "\n".join(lines) + "\n"


def flatten(content: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in content.items():
        if isinstance(value, dict):
            items += flatten(value, f"{prefix}{key}.")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for row in value:
                label = f"{prefix}batch {row['batch']}." if "batch" in row else prefix
                items += flatten({k: v for k, v in row.items() if k != "batch"}, label)
        else:
            items.append((f"{prefix}{key}", value))
    return items


def format_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value).replace("|", "/")[:200]


# ---- main ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the folder of gpu-check.json and gpu-check.md")
    parser.add_argument("--minutes", type=float, default=8.0, help="the whole run's time budget")
    parser.add_argument("--dry-run", action="store_true", help="the same code on the CPU with tiny shapes")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton loads: the kernels run in its interpreter
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("the GPU check needs a CUDA device and torch sees none; --dry-run runs it on the CPU", file=sys.stderr)
        return 2
    plan = DRY if args.dry_run else FULL
    budget_s = args.minutes * 60
    # A hang (a stuck compile, a deadlocked capture) prints every thread's stack and ends the run; the
    # report written so far stays.
    faulthandler.dump_traceback_later(budget_s + 60, exit=True)
    info = machine_info(plan.device) | {"plan": asdict(plan)}
    run, report = Run(plan, info["gpu"]), Report(args.out, info)
    started = time.monotonic()
    ok = [run_section(run, report, name, budget_s) for name in SECTIONS]
    paths = report.write()
    faulthandler.cancel_dump_traceback_later()
    print(f"done in {time.monotonic() - started:.0f} s: {', '.join(map(str, paths))}", flush=True)
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
