"""Speculative decoding on the decode pool of a real Ray cluster (1 prefill + 1 decode worker), n-gram
drafts and a draft model's: the greedy tokens are those of an engine without speculation, drafts were
accepted on the decode worker (whose engine alone speculates), and its counters reach the gateway's
/metrics as vLLM names them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.serving.process import gateway_metrics
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_spec_decode import RANDOM, REPETITIVE, RUN
from tests.helpers import fp32_engine
from tests.observability.scrape import samples, value
from tests.ray_cluster.test_ray_cluster import alone, assert_pools_whole, generate_all

pytestmark = pytest.mark.usefixtures("ray_session")
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("spec-ray"), num_layers=2, hidden=64, heads=4,
                                       kv_heads=2)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_on_the_decode_pool_keeps_the_greedy_tokens(checkpoint: Path, method: str) -> None:
    """The draft model is the served one (deterministic mode): every draft it makes is accepted, so the
    decode worker ran the draft model on the history the prefill worker sent."""
    engine = fp32_engine(checkpoint, block_size=4, num_blocks=256, deterministic=True)
    speculative = SPECULATIVE if method == "ngram" else {"model": str(checkpoint), "num_speculative_tokens": 4}
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1),
                           decode=PoolConfig(replicas=1, num_cpus=0.1, engine={"speculative_config": speculative}),
                           engine=engine)
    prompts = [RUN, *REPETITIVE, *RANDOM]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = alone(engine, prompts, params)
    cluster = Cluster(config).start()
    try:
        assert generate_all(cluster, prompts, params) == expected
        loads = {load.role: load for load in asyncio.run(cluster.workers())}
        decode, prefill = loads["decode"], loads["prefill"]
        assert decode.num_speculative_tokens == 4 and prefill.num_speculative_tokens == 0
        assert decode.spec_decode_num_accepted_tokens > 0
        if method == "ngram":
            assert decode.spec_decode_num_draft_tokens > decode.spec_decode_num_accepted_tokens
        else:
            assert decode.spec_decode_num_draft_tokens == decode.spec_decode_num_accepted_tokens
        scraped = samples(asyncio.run(gateway_metrics("tiny", config).exposition(list(loads.values()))).decode())
        assert value(scraped, "vllm:spec_decode_num_accepted_tokens_total", role="decode") == \
            decode.spec_decode_num_accepted_tokens
        assert value(scraped, "vllm:spec_decode_num_accepted_tokens_per_pos_total", role="decode",
                     position="0") > 0
        assert_pools_whole(cluster)
    finally:
        cluster.stop()
