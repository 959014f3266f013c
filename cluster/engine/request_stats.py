"""vLLM's per-request histograms, counted in the engine where each phase happens.

A request's phases, by the engine's clock (`time.monotonic`): arrival -> first scheduled
(`running_since`) -> first token (`first_token_time`) -> finished. As vLLM's v1 metrics: queue time
is arrival to first scheduled, prefill time first scheduled to first token, decode time first token
to the last, inference time first scheduled to the last (preemptions included in whichever phase
they interrupt).

In the disaggregated cluster each worker counts only its own part, so that a request is counted
once per phase across the cluster:
- a prefill for another worker (`hold_kv`) counts queue, prefill and inference time and its prompt's
  length; its one sampled token is part of the prefill, so no decode time and no generation length;
- a request whose KV came from a prefill worker (`remote_kv_time` set) counts decode and inference
  time and its generation length; its first token is the prefill's, taken in when the KV landed;
- anything else (colocated, or a decode worker's recompute when the KV never came) counts all.
Only requests that finished by themselves (stop, length) are counted, as `seconds_per_request`.
"""

from __future__ import annotations

import time
from dataclasses import replace

from cluster.common.loads import BucketCounts
from cluster.engine.request import Request

# vLLM's buckets, so dashboards built for vLLM read the same quantiles.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

QUEUE_TIME = "vllm:request_queue_time_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
DECODE_TIME = "vllm:request_decode_time_seconds"
INFERENCE_TIME = "vllm:request_inference_time_seconds"
PROMPT_TOKENS = "vllm:request_prompt_tokens"
GENERATION_TOKENS = "vllm:request_generation_tokens"
ITERATION_TOKENS = "vllm:iteration_tokens_total"


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class RequestStats:
    """The engine's histograms since it started, by vLLM metric name (carried in `WorkerLoad`)."""

    def __init__(self, max_model_len: int) -> None:
        lengths = one_two_five_buckets(max_model_len)
        self.histograms = {name: BucketCounts(REQUEST_LATENCY_BUCKETS)
                           for name in (QUEUE_TIME, PREFILL_TIME, DECODE_TIME, INFERENCE_TIME)}
        self.histograms[PROMPT_TOKENS] = BucketCounts(lengths)
        self.histograms[GENERATION_TOKENS] = BucketCounts(lengths)
        self.histograms[ITERATION_TOKENS] = BucketCounts(ITERATION_TOKEN_BUCKETS)

    def snapshot(self) -> dict[str, BucketCounts]:
        """Copies, to carry across threads while the engine counts on."""
        return {name: replace(counts, counts=list(counts.counts)) for name, counts in self.histograms.items()}

    def step(self, num_tokens: int) -> None:
        """A step that ran: the tokens it computed (prompt chunks and decodes together)."""
        self.histograms[ITERATION_TOKENS].observe(num_tokens)

    def finished(self, request: Request, now: float | None = None) -> None:
        """`request` just finished here by itself (stop or length): count its phases on this worker."""
        now = time.monotonic() if now is None else now
        scheduled = request.running_since
        first_token = request.first_token_time if request.first_token_time is not None else now
        if request.remote_kv_time is None:  # the prompt was computed here
            scheduled = first_token if scheduled is None else scheduled
            self.histograms[QUEUE_TIME].observe(scheduled - request.arrival_time)
            # 0 for a recompute after the prefill's streamed first token: that token came before this run.
            self.histograms[PREFILL_TIME].observe(max(first_token - scheduled, 0.0))
            self.histograms[PROMPT_TOKENS].observe(request.num_prompt_tokens)
        if not request.hold_kv:  # the tokens after the first were generated here
            self.histograms[DECODE_TIME].observe(now - first_token)
            self.histograms[GENERATION_TOKENS].observe(request.num_output_tokens)
        end = first_token if request.hold_kv else now
        self.histograms[INFERENCE_TIME].observe(end - scheduled if scheduled is not None else 0.0)
