"""/metrics after real requests: the counts and histograms add up (vLLM's names, one scrape)."""

from __future__ import annotations

from tests.observability.conftest import MAX_TOKENS, PROMPTS
from tests.observability.scrape import samples, value

WORKER = {"worker": "local-0", "role": "colocated"}


def test_metrics_add_up_after_real_requests(live_scrape: str) -> None:
    scraped = samples(live_scrape)
    requests = len(PROMPTS)
    assert value(scraped, "vllm:request_success_total", finished_reason="length") == requests
    assert value(scraped, "vllm:generation_tokens_total") == requests * MAX_TOKENS
    assert value(scraped, "vllm:prompt_tokens_total") == sum(len(p) for p in PROMPTS)
    assert value(scraped, "vllm:time_to_first_token_seconds_count") == requests
    assert value(scraped, "vllm:inter_token_latency_seconds_count") == requests * (MAX_TOKENS - 1)
    assert value(scraped, "vllm:e2e_request_latency_seconds_count") == requests
    ttft_sum = value(scraped, "vllm:time_to_first_token_seconds_sum")
    assert 0 < ttft_sum <= value(scraped, "vllm:e2e_request_latency_seconds_sum")
    assert value(scraped, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == requests
    # The worker's own numbers, labelled by worker and role: idle and whole after the requests.
    assert value(scraped, "vllm:num_requests_running", **WORKER) == 0
    assert value(scraped, "vllm:kv_cache_usage_perc", worker="local-0") == 0
    assert value(scraped, "pdserve:kv_cache_free_blocks", worker="local-0") == 64
    assert value(scraped, "vllm:prefix_cache_queries_total", worker="local-0") >= sum(len(p) for p in PROMPTS)
    assert value(scraped, "pdserve:workers", role="colocated") == 1


def test_request_phases_are_timed_in_the_engine(live_scrape: str) -> None:
    """vLLM's per-request histograms, from the worker's engine: every phase of each request once
    (a colocated worker runs them all), lengths exact, and the phases inside what the client saw."""
    scraped = samples(live_scrape)
    requests = len(PROMPTS)
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value(scraped, f"vllm:request_{phase}_time_seconds_count", **WORKER) == requests, phase
        assert value(scraped, f"vllm:request_{phase}_time_seconds_bucket", le="+Inf", **WORKER) == requests
    prefill = value(scraped, "vllm:request_prefill_time_seconds_sum", **WORKER)
    decode = value(scraped, "vllm:request_decode_time_seconds_sum", **WORKER)
    inference = value(scraped, "vllm:request_inference_time_seconds_sum", **WORKER)
    queue = value(scraped, "vllm:request_queue_time_seconds_sum", **WORKER)
    assert 0 < prefill < inference and abs(prefill + decode - inference) < 1e-6  # first token splits the run
    assert queue + inference <= value(scraped, "vllm:e2e_request_latency_seconds_sum")  # the gateway's, around it
    assert value(scraped, "vllm:request_prompt_tokens_sum", **WORKER) == sum(len(p) for p in PROMPTS)
    assert value(scraped, "vllm:request_prompt_tokens_bucket", le="5.0", **WORKER) == 1  # 4 tokens; 6 and 9 above
    assert value(scraped, "vllm:request_generation_tokens_sum", **WORKER) == requests * MAX_TOKENS
    # Every step's tokens: each prompt once (no shared prefix) and each token after the first.
    assert value(scraped, "vllm:iteration_tokens_total_sum", **WORKER) == \
        sum(len(p) for p in PROMPTS) + requests * (MAX_TOKENS - 1)
    info = [labels for (name, labels), v in scraped.items() if name == "vllm:cache_config_info" and v == 1]
    assert len(info) == 1 and {("block_size", "4"), ("num_gpu_blocks", "64"), ("worker", "local-0"),
                               ("cache_dtype", "auto"), ("kv_cache_dtype", "auto")} <= set(info[0])
    # Preemption here recomputes: no swapped-requests series (a constant 0 would say swap is on).
    assert not [name for name, _ in scraped if name == "vllm:num_requests_swapped"]
