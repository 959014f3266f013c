"""What speculative decoding buys: the same requests through engines without speculation, with n-gram
drafts and with a draft model's, alternated in one run, on a repetitive workload and a non-repetitive one.

    python -m benchmarks.spec_decode                         # the default model, dtype auto
    python -m benchmarks.spec_decode --num-speculative-tokens 4 --prompt-lookup-min 2 --prompt-lookup-max 4
    python -m benchmarks.spec_decode --draft-model PATH      # a draft checkpoint of the served model's tokenizer

Without `--draft-model` the draft is the served model itself: every greedy draft is accepted (up to
bf16's rounding), a draft costs what a token costs, and the arm measures what the draft-model machinery
costs against the n-gram one. A draft model pays where it is several times cheaper per token than the
served model and agrees with it most of the time (a family's small model drafting for its large one).

Repetitive: chat prompts whose answers copy the prompt (code edits that keep most of the code,
passages quoted before they are summarized). Non-repetitive: open questions. Each prompt runs alone
(batch 1, where a step's time is the token's) and all of a workload's prompts together (a batch),
greedy, `--max-tokens` each. Per arm: inter-token latency (a request's decode time over its tokens
after the first, the mean over requests; tokens of one step arrive together, so this is the time a
token costs), output tokens per second of the batch, and the drafts' acceptance. Whether the greedy
tokens are the same in both arms is recorded: in bf16 a row of drafts rounds differently from a
decode and answers may part after some tokens; in fp32 or `--deterministic` they are the same.
Writes benchmarks/results/spec-decode.<machine>.<date>.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.common import machine, print_table, save
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from cluster.engine.llm_engine import LLMEngine

CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    discount = 0
    if subtotal > 100:
        discount = subtotal * 0.05
    taxed = (subtotal - discount) * (1 + tax_rate)
    return round(taxed, 2)'''
PASSAGE = ("The lighthouse keeper climbed the stairs every evening at dusk. He wound the clockwork, trimmed the "
           "wick and polished the great lens until it shone. Ships passing the rocks at night saw the beam sweep "
           "across the water every ten seconds, and they knew where the danger lay.")
WORKLOADS = {
    "repetitive": [
        f"Rename the variable subtotal to net_amount in this Python function. Reply with the whole function "
        f"only.\n\n{CODE}",
        f"Add a docstring to this Python function and change nothing else. Reply with the whole function.\n\n{CODE}",
        f"Quote this passage word for word, then summarize it in one sentence.\n\n{PASSAGE}",
        f"Repeat the following text exactly, then say what it is about.\n\n{PASSAGE}",
    ],
    "non-repetitive": [
        "Write a short poem about autumn rain.",
        "Give three tips for learning to play the guitar.",
        "Explain why the sky is blue to a ten year old.",
        "Describe a good breakfast for a busy morning.",
    ],
}


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """The prompts together to their ends: tokens, the mean inter-token latency, tokens per second."""
    stats_before = engine.stats().spec_decode
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    arrivals: dict[str, list[float]] = {request.request_id: [] for request in requests}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            arrivals[output.request_id] += [now] * len(output.new_token_ids)
    seconds = time.perf_counter() - started
    itls = [(times[-1] - times[0]) / (len(times) - 1) for times in arrivals.values() if len(times) > 1]
    stats = engine.stats().spec_decode
    result: dict[str, Any] = {
        "tokens": [list(request.output_token_ids) for request in requests],
        "itl_ms": 1000 * statistics.mean(itls), "output_tokens_per_s": sum(map(len, arrivals.values())) / seconds}
    if stats is not None and stats_before is not None:
        drafted = stats.num_draft_tokens - stats_before.num_draft_tokens
        accepted = stats.num_accepted_tokens - stats_before.num_accepted_tokens
        steps = stats.num_drafts - stats_before.num_drafts
        result |= {"draft_tokens": drafted, "accepted_tokens": accepted,
                   "acceptance_rate": accepted / drafted if drafted else 0.0,
                   "mean_accepted_length": 1 + accepted / steps if steps else 1.0}
    return result


def measure(engines: dict[str, LLMEngine], prompts: list[list[int]], params: SamplingParams,
            repeats: int) -> dict[str, dict[str, Any]]:
    """Per arm: the batch of all prompts, and each prompt alone, `repeats` times alternated; medians."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {arm: {"batch": [], "alone": []} for arm in engines}
    for _ in range(repeats):
        for arm, engine in engines.items():
            runs[arm]["batch"].append(run(engine, prompts, params))
            runs[arm]["alone"].append(merge([run(engine, [prompt], params) for prompt in prompts]))
    return {arm: {kind: summarize(results) for kind, results in kinds.items()} for arm, kinds in runs.items()}


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompts run one at a time, as one result: mean ITL, summed tokens and counters."""
    merged: dict[str, Any] = {"tokens": [tokens for r in results for tokens in r["tokens"]],
                              "itl_ms": statistics.mean(r["itl_ms"] for r in results),
                              "output_tokens_per_s": statistics.mean(r["output_tokens_per_s"] for r in results)}
    if "draft_tokens" in results[0]:
        drafted = sum(r["draft_tokens"] for r in results)
        accepted = sum(r["accepted_tokens"] for r in results)
        merged |= {"draft_tokens": drafted, "accepted_tokens": accepted,
                   "acceptance_rate": accepted / drafted if drafted else 0.0,
                   "mean_accepted_length": statistics.mean(r["mean_accepted_length"] for r in results)}
    return merged


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    summary = {key: statistics.median(r[key] for r in results) for key in results[0] if key != "tokens"}
    return {**summary, "tokens": results[0]["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--draft-model", default=None,
                        help="the draft's checkpoint, of the served model's tokenizer (default: the served model)")
    args = parser.parse_args()
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=args.num_speculative_tokens,
                              prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    arms = {"off": SpeculativeConfig(), "ngram": ngram,
            "draft": SpeculativeConfig(method="draft_model", model=args.draft_model or args.model,
                                       num_speculative_tokens=args.num_speculative_tokens)}
    engines = {arm: LLMEngine(EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype),
                                           cache=CacheConfig(kv_cache_memory_gb=1.0), speculative=speculative))
               for arm, speculative in arms.items()}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for engine in engines.values():
        engine.warm_up()
    results: dict[str, Any] = {}
    for name, texts in WORKLOADS.items():
        prompts = [engines["off"].chat_prompt([{"role": "user", "content": text}]) for text in texts]
        results[name] = measure(engines, prompts, params, args.repeats)
        for kind in ("alone", "batch"):
            off = results[name]["off"][kind].pop("tokens")
            for arm in ("ngram", "draft"):
                results[name][arm][kind]["same_tokens_as_off"] = results[name][arm][kind].pop("tokens") == off
    report(results)
    save("spec-decode", {"config": vars(args), "results": results}, machine("benchmarks.spec_decode"))


def report(results: dict[str, Any]) -> None:
    rows = []
    for name, arms in results.items():
        for kind in ("alone", "batch"):
            off = arms["off"][kind]
            for arm in ("ngram", "draft"):
                on = arms[arm][kind]
                rows.append([name, kind, arm, off["itl_ms"], on["itl_ms"], off["output_tokens_per_s"],
                             on["output_tokens_per_s"], on["output_tokens_per_s"] / off["output_tokens_per_s"],
                             on["acceptance_rate"], on["mean_accepted_length"], on["same_tokens_as_off"]])
    print_table("speculative decoding, off vs n-gram vs draft model",
                ["workload", "run", "drafts", "ITL off ms", "ITL on ms", "tok/s off", "tok/s on", "speed-up",
                 "accepted", "tokens/step", "same tokens"], rows)


if __name__ == "__main__":
    main()
