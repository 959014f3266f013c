"""Worker-level series: each phase counted on the worker where it happens, one series per worker
however many gateways are scraped, and swap metrics only where swap is on."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.ray_cluster.config import ClusterConfig
from cluster.serving.process import gateway_metrics
from tests.engine.test_disaggregation import drain, make_engine, run_prefill
from tests.helpers import until_idle
from tests.observability.scrape import samples, value

PROMPT = [5, 17, 33, 9, 81, 120, 7, 7, 64, 11]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PHASES = ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds", "prompt_tokens", "generation_tokens")


def phase_counts(engine: LLMEngine) -> dict[str, int]:
    histograms = engine.stats().histograms
    return {phase: histograms[f"vllm:request_{phase}"].count for phase in PHASES}


def test_disaggregated_phases_are_counted_where_they_happen(checkpoint: Path) -> None:
    """The prefill worker counts the queue and prefill and the prompt; the decode worker the decode
    and the generated tokens: each once across the two, as for one colocated worker."""
    prefill, decode = make_engine(checkpoint), make_engine(checkpoint)
    assert decode.reserve_remote(PROMPT, PARAMS, request_id="r") is not None
    first = run_prefill(prefill, PROMPT, "r", PARAMS)
    decode.import_kv("r", prefill.export_kv("r").data.clone())
    prefill.release_held("r")
    decode.admit_remote("r", first)
    drain(decode)
    assert phase_counts(prefill) == {"queue_time_seconds": 1, "prefill_time_seconds": 1, "decode_time_seconds": 0,
                                     "prompt_tokens": 1, "generation_tokens": 0}
    assert phase_counts(decode) == {"queue_time_seconds": 0, "prefill_time_seconds": 0, "decode_time_seconds": 1,
                                    "prompt_tokens": 0, "generation_tokens": 1}
    assert decode.stats().histograms["vllm:request_generation_tokens"].total == PARAMS.max_tokens
    assert prefill.stats().histograms["vllm:request_prompt_tokens"].total == len(PROMPT)
    # Each engine counted the steps it ran: the prompt there, the decodes here.
    assert prefill.stats().histograms["vllm:iteration_tokens_total"].total == len(PROMPT)
    assert decode.stats().histograms["vllm:iteration_tokens_total"].total == PARAMS.max_tokens - 1


def test_swapped_requests_are_counted_while_their_kv_is_out(checkpoint: Path) -> None:
    """Two requests that outgrow the pool: with swap, the one preempted waits swapped out, and the
    engine's stats (what the worker's load carries) say so until it is swapped back in."""
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(checkpoint)),
                                    cache=CacheConfig(block_size=4, num_blocks=6, num_swap_blocks=8),
                                    scheduler=SchedulerConfig(preemption_mode="swap")))
    for index in range(2):
        engine.add_request([5 + index] * 8, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    swapped = []
    for _ in until_idle(engine):
        engine.step()
        swapped.append(engine.stats().num_swapped)
    assert 1 in swapped and swapped[-1] == 0 and engine.stats().num_preemptions >= 1


def loads() -> list[WorkerLoad]:
    prefill = WorkerLoad("prefill-0", "prefill", 1, 2, 10, 64, 0.8, cache_config={"block_size": "16"})
    decode = WorkerLoad("decode-0", "decode", 3, 0, 5, 64, 0.9, num_swapped=2, swap_enabled=True,
                        cache_config={"block_size": "16"})
    return [prefill, decode]


def scrape(config: ClusterConfig) -> str:
    return asyncio.run(gateway_metrics("tiny", config).exposition(loads())).decode()


def test_two_gateways_on_one_cluster_count_each_worker_once() -> None:
    """The gateway that owns the workers and one attached to them (`--attach`), both scraped: summed
    over the two scrapes, as a dashboard's `sum` does, each worker's series counts once."""
    owner = samples(scrape(ClusterConfig()))
    attached_text = scrape(ClusterConfig(attach=True, redis_url="redis://localhost:6379"))
    attached = samples(attached_text)
    both = owner | {(name, (("gateway", "attached"), *labels)): v for (name, labels), v in attached.items()}
    assert value(both, "vllm:num_requests_running", worker="decode-0") == 3
    assert value(both, "vllm:num_requests_waiting") == 2
    assert value(both, "pdserve:workers", role="decode") == 1
    assert sum(v for (name, _), v in both.items() if name == "vllm:cache_config_info") == 2  # one per worker
    # The attached gateway's own request metrics are there: each request passes one gateway.
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in attached_text


def test_swapped_requests_only_where_swap_is_on() -> None:
    scraped = samples(scrape(ClusterConfig()))
    assert value(scraped, "vllm:num_requests_swapped", worker="decode-0", role="decode") == 2
    assert [labels for name, labels in scraped if name == "vllm:num_requests_swapped"] == \
        [(("model_name", "tiny"), ("role", "decode"), ("worker", "decode-0"))]


def test_the_host_kv_tier_series_come_from_the_engine_where_it_has_one(checkpoint: Path) -> None:
    """A worker whose engine has a host tier shows its hits, queries, moves and usage; one without has
    no series (rather than constant zeros)."""
    from cluster.worker.worker import host_kv_fields
    from tests.engine.test_host_kv_tier import WORKLOAD, run_in_turn, tier_engine

    engine = tier_engine(checkpoint, num_blocks=16, num_host_kv_blocks=64)
    run_in_turn(engine)
    tiered = WorkerLoad("decode-1", "decode", 0, 0, 16, 16, 0.0, **host_kv_fields(engine.stats()))
    text = asyncio.run(gateway_metrics("tiny", ClusterConfig()).exposition([*loads(), tiered])).decode()
    scraped = samples(text)
    hits = value(scraped, "pdserve:host_kv_cache_hits_total", worker="decode-1")
    assert hits == 8 * 5 * 4 and value(scraped, "pdserve:host_kv_blocks_promoted_total", worker="decode-1") == 8 * 5
    assert value(scraped, "pdserve:host_kv_cache_queries_total", worker="decode-1") >= hits
    assert value(scraped, "pdserve:host_kv_blocks_offloaded_total", worker="decode-1") >= 8 * 5
    assert value(scraped, "pdserve:host_kv_cache_blocks", worker="decode-1") == 64
    assert 0 < value(scraped, "pdserve:host_kv_cache_usage_perc", worker="decode-1") <= 1
    assert {labels for name, labels in scraped if name.startswith("pdserve:host_kv")} == \
        {(("model_name", "tiny"), ("role", "decode"), ("worker", "decode-1"))}
    assert len(WORKLOAD) == 16
