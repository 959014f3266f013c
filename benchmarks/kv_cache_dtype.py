"""What an fp8 KV cache costs in accuracy: the engine's greedy tokens against transformers in fp32.

    python -m benchmarks.kv_cache_dtype [--kv-cache-dtypes auto fp8 fp8_e5m2] [--dtype auto]
                                        [--max-tokens 128]

The default model, real text prompts (below), greedy decoding with EOS ignored. For each KV cache dtype
(`CacheConfig.kv_cache_dtype`), one engine generates every prompt's tokens; transformers in fp32 on the
same weights is the oracle, two ways:
- agreement: transformers reads each prompt with the engine's own tokens after it (teacher forcing) and
  gives its argmax at every generated position; the share of the engine's tokens that equal it. Where
  they differ, `gap` is how far the engine's token's log-probability lies below the argmax's under fp32
  (small gaps: near ties that any rounding flips; large ones: real errors).
- first divergence: where the engine's greedy sequence first leaves transformers' own greedy one (its
  median over the prompts; `--max-tokens` when they never part).
`auto` (the model's dtype) is the baseline in the same run: bf16 itself moves tokens against fp32.

And what it gains where memory is short (`--parts capacity`): the 64-request workload of
`benchmarks.engine vs-transformers` (random prompts of 16-256 tokens, lognormal outputs, EOS ignored)
through one engine whose pool holds the model's-dtype KV of `--pool-fraction` of the requests at their
full length; each fp8 arm gets the same bytes, so more blocks. Output tokens/s, preemptions, steps.
Speed per step is `python -m benchmarks.engine step-vs-linear --kv-cache-dtypes ...`. Results go to
benchmarks/results/kv-cache-dtype.<machine>.<date>.json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported anywhere

import torch  # noqa: E402

from benchmarks.common import machine, png_path, print_table, save  # noqa: E402
from cluster.bench import engine_runs as workloads  # noqa: E402
from cluster.bench import plots  # noqa: E402
from cluster.bench.offline import synthetic_workload  # noqa: E402
from cluster.common.sampling_params import SamplingParams  # noqa: E402
from cluster.engine.config import KV_CACHE_DTYPES, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from cluster.engine.llm_engine import LLMEngine  # noqa: E402
from cluster.model.device import resolve_dtype, resolve_kv_cache_dtype  # noqa: E402
from cluster.model.runner import DTYPES  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain how a transformer neural network works in simple terms.",
    "List three prime numbers and explain why they are prime.",
    "Once upon a time in a small village,",
    "def fibonacci(n):",
    "The main causes of the French Revolution were",
    "Here is a recipe for a simple tomato soup:",
    "In physics, the law of conservation of energy states that",
    "Dear hiring manager, I am writing to apply for",
    "The difference between a list and a tuple in Python is",
    "Photosynthesis is the process by which",
]


def generate(kv_cache_dtype: str, dtype: str, max_tokens: int) -> tuple[LLMEngine, list[list[int]], list[list[int]]]:
    """(engine, prompts' token ids, each prompt's greedy tokens) with this KV cache."""
    engine = LLMEngine(EngineConfig(model=ModelConfig(dtype=dtype),
                                    cache=CacheConfig(kv_cache_memory_gb=0.5, kv_cache_dtype=kv_cache_dtype)))
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    return engine, prompts, [list(output.token_ids) for output in outputs]


@torch.inference_mode()
def score(oracle: Any, prompts: list[list[int]], generated: list[list[int]],
          greedy: list[list[int]]) -> dict[str, Any]:
    agree, gaps, divergences = [], [], []
    for prompt, tokens, reference in zip(prompts, generated, greedy, strict=True):
        logprobs = oracle(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].float().log_softmax(-1)
        chosen = torch.tensor(tokens)
        best = logprobs.argmax(-1)
        agree.append((best == chosen).float().mean().item())
        differ = best != chosen
        gaps += (logprobs.max(-1).values - logprobs.gather(1, chosen[:, None])[:, 0])[differ].tolist()
        divergences.append(next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b),
                                len(tokens)))
    return {"agreement": statistics.mean(agree), "agreement_per_prompt": agree,
            "gap_median": statistics.median(gaps) if gaps else 0.0, "gap_max": max(gaps, default=0.0),
            "first_divergence_median": statistics.median(divergences), "first_divergence": divergences}


def capacity(kv_cache_dtypes: list[str], dtype: str, num_requests: int, pool_fraction: float) -> dict[str, Any]:
    """Tokens/s and preemptions of one workload through a pool of one size in bytes, per KV cache dtype."""
    workload = synthetic_workload(num_requests, workloads.VOCAB_SIZE, seed=2)
    model_dtype = resolve_dtype(dtype, torch.device("cpu"))[0]
    base_blocks = workloads.undersized_pool(workload, pool_fraction)
    arms = {}
    for kv_cache_dtype in kv_cache_dtypes:
        ratio = DTYPES[model_dtype].itemsize // DTYPES[resolve_kv_cache_dtype(kv_cache_dtype, model_dtype)].itemsize
        config = EngineConfig(model=ModelConfig(dtype=dtype),
                              cache=CacheConfig(num_blocks=base_blocks * ratio, kv_cache_dtype=kv_cache_dtype),
                              scheduler=SchedulerConfig(max_num_seqs=num_requests))
        result, _ = workloads.run_arm(config, workload, kv_cache_dtype)
        arms[kv_cache_dtype] = {**result.as_dict(), "num_blocks": base_blocks * ratio}
    return {"num_requests": num_requests, "pool_fraction": pool_fraction, "model_dtype": model_dtype,
            "output_tokens": workload.num_output_tokens, "arms": arms}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_cache_dtype", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8", "fp8_e5m2"],
                        choices=list(KV_CACHE_DTYPES))
    parser.add_argument("--dtype", default="auto", help="the model's (auto: by the CPU)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--parts", nargs="+", choices=["accuracy", "capacity"], default=["accuracy", "capacity"])
    parser.add_argument("--num-requests", type=int, default=64, help="capacity: the workload's requests")
    parser.add_argument("--pool-fraction", type=float, default=0.5,
                        help="capacity: the requests whose KV the pool holds in the model's dtype")
    args = parser.parse_args()
    info = machine("benchmarks.kv_cache_dtype")
    results: dict[str, Any] = {}
    if "capacity" in args.parts:
        results["capacity"] = capacity(args.kv_cache_dtypes, args.dtype, args.num_requests, args.pool_fraction)
        print_table(f"{args.num_requests} requests, a pool for ~{args.pool_fraction:.0%} of them in the model's dtype",
                    ["KV cache", "blocks", "tok/s", "preemptions", "steps", "seconds"],
                    [[name, arm["num_blocks"], arm["tokens_per_second"], arm["num_preemptions"], arm["num_steps"],
                      arm["seconds"]] for name, arm in results["capacity"]["arms"].items()])
    if "accuracy" in args.parts:
        results["accuracy"] = accuracy(args)
    save("kv-cache-dtype", {"max_tokens": args.max_tokens, "prompts": PROMPTS, **results}, info)
    if "accuracy" in results:
        plots.bars(png_path("kv-cache-dtype"),
                   {name: 100 * arm["agreement"] for name, arm in results["accuracy"].items()},
                   "% of tokens = fp32 argmax", "greedy agreement with transformers fp32, by KV cache dtype")


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    arms, oracle, greedy = {}, None, None
    for kv_cache_dtype in args.kv_cache_dtypes:
        engine, prompts, generated = generate(kv_cache_dtype, args.dtype, args.max_tokens)
        if oracle is None:
            oracle = transformers.AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
            with torch.inference_mode():
                greedy = [oracle.generate(torch.tensor([p]), max_new_tokens=args.max_tokens, do_sample=False,
                                          min_new_tokens=args.max_tokens)[0, len(p):].tolist() for p in prompts]
        assert greedy is not None
        arms[kv_cache_dtype] = {"dtype": engine.dtype, "kv_cache_dtype": engine.kv_cache_dtype,
                                **score(oracle, prompts, generated, greedy)}
    print_table(f"greedy tokens against transformers fp32 ({len(PROMPTS)} prompts x {args.max_tokens} tokens)",
                ["KV cache", "model", "agreement", "gap median", "gap max", "first divergence (median)"],
                [[name, arm["dtype"], arm["agreement"], arm["gap_median"], arm["gap_max"],
                  arm["first_divergence_median"]] for name, arm in arms.items()])
    return arms


if __name__ == "__main__":
    main()
