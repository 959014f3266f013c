"""The architectures beyond Llama on the cluster path (1 prefill + 1 decode worker): a mixture of experts, a
Gemma 2 with soft caps and sliding local layers (the KV of a window crosses from prefill to decode), and a
GGUF file kept packed on both workers. Each gives the tokens of one engine alone, and every block comes back."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.weights.synthetic import build_random_llama, build_tiny_llama_checkpoint, build_tiny_tokenizer
from tests.helpers import fp32_engine, write_tiny_gguf
from tests.ray_cluster.test_ray_cluster import alone, assert_pools_whole, generate_all
from tests.weights.test_gguf_packed import quantized_names

pytestmark = pytest.mark.usefixtures("ray_session")
# Longer than the Gemma model's window of 6, so decode attends past it through KV the prefill worker wrote.
PROMPTS = [[5, 17, 33, 9, 81, 120, 44, 7, 250, 19, 3, 61], [200, 3, 77, 12], [9, 9, 140, 31, 88, 2 + 100, 64, 15]]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def qwen3_moe(path: Path) -> Path:
    build_random_llama(path, architecture="qwen3_moe", num_layers=3, head_dim=32,
                       moe=dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0]))
    return build_tiny_tokenizer(path)


def gemma2(path: Path) -> Path:
    build_random_llama(path, architecture="gemma2", num_layers=4, sliding_window=6, tie_word_embeddings=True,
                       extra_config={"attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0,
                                     "query_pre_attn_scalar": 24})
    return build_tiny_tokenizer(path)


def gguf_packed(path: Path) -> Path:
    checkpoint = build_tiny_llama_checkpoint(path / "hf", hidden=64, heads=4, kv_heads=2, tie=True)
    return write_tiny_gguf(checkpoint, path / "model.gguf", quantize=quantized_names(2, mixed=True))


MODELS = {"qwen3_moe": (qwen3_moe, {}), "gemma2": (gemma2, {}), "gguf-packed": (gguf_packed, {"quantization": "gguf"})}


@pytest.mark.parametrize("name", list(MODELS))
def test_each_architecture_gives_the_engines_tokens_through_the_cluster(tmp_path: Path, name: str) -> None:
    build, fields = MODELS[name]
    engine = fp32_engine(build(tmp_path / name), block_size=4, num_blocks=128, **fields)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine)
    expected = alone(engine, PROMPTS, GREEDY)
    cluster = Cluster(config).start()
    try:
        assert generate_all(cluster, PROMPTS, GREEDY) == expected
        assert_pools_whole(cluster)
    finally:
        cluster.stop()
