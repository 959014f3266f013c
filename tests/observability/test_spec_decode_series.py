"""Speculative decoding's counters, from a decode worker's engine to /metrics under vLLM's names:
`vllm:spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens` and
`_num_accepted_tokens_per_pos` (label `position`), only for workers that speculate."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.ray_cluster.config import ClusterConfig
from cluster.serving.process import gateway_metrics
from cluster.worker.worker import spec_decode_fields
from tests.observability.scrape import samples, value

SPECULATIVE = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)


def test_a_speculating_worker_exports_vllms_spec_decode_counters(checkpoint: Path) -> None:
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(checkpoint), dtype="float32"),
                                    cache=CacheConfig(block_size=4, num_blocks=256), speculative=SPECULATIVE))
    engine.generate([[5] * 12, [9, 8, 9, 8, 9, 8]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
    decode = WorkerLoad("decode-0", "decode", 0, 0, 256, 256, 0.0, **spec_decode_fields(engine.stats(),
                                                                                         SPECULATIVE))
    plain = WorkerLoad("decode-1", "decode", 0, 0, 256, 256, 0.0)
    text = asyncio.run(gateway_metrics("tiny", ClusterConfig()).exposition([decode, plain])).decode()
    scraped = samples(text)
    assert value(scraped, "vllm:spec_decode_num_drafts_total", worker="decode-0") == stats.num_drafts
    assert value(scraped, "vllm:spec_decode_num_draft_tokens_total", worker="decode-0") == stats.num_draft_tokens
    assert value(scraped, "vllm:spec_decode_num_accepted_tokens_total", worker="decode-0") == \
        stats.num_accepted_tokens
    per_position = [value(scraped, "vllm:spec_decode_num_accepted_tokens_per_pos_total", worker="decode-0",
                          position=str(position)) for position in range(3)]
    assert per_position == [*stats.accepted_per_position, 0, 0, 0][:3] and per_position[0] > 0
    assert sum(per_position) == stats.num_accepted_tokens
    assert not [labels for name, labels in scraped if name.startswith("vllm:spec_decode") and
                ("worker", "decode-1") in labels]  # no series where speculation is off
