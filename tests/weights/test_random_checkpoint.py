"""Random checkpoints in memory: the tensors a real checkpoint of the shape holds, made on the device
in the serving dtype, the same for the same seed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import llama_tensor_shapes, random_checkpoint

TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
}


@pytest.mark.parametrize("fields", [{}, {"attention_bias": True}, {"tie_word_embeddings": True}])
def test_the_tensors_are_transformers_own(fields: dict[str, Any]) -> None:
    import transformers

    config = transformers.LlamaConfig(**{key: value for key, value in (TINY | fields).items()
                                         if key != "architectures"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()
                if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    assert dict(llama_tensor_shapes(TINY | fields)) == expected


def greedy(seed: int, dtype: str = "bfloat16") -> tuple[list[list[int]], LLMEngine]:
    checkpoint = random_checkpoint(TINY, device="cpu", dtype=getattr(torch, dtype), seed=seed)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model="random-tiny", dtype=dtype, device="cpu"),
                                    cache=CacheConfig(block_size=4, num_blocks=64)), checkpoint=checkpoint)
    outputs = engine.generate([[5, 17, 900, 33], [7] * 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return [output.token_ids for output in outputs], engine


def test_an_engine_runs_on_it_in_its_dtype() -> None:
    tokens, engine = greedy(seed=0)
    assert [len(ids) for ids in tokens] == [6, 6]
    assert all(0 <= token < TINY["vocab_size"] for ids in tokens for token in ids)
    assert {parameter.dtype for parameter in engine.runner.model.parameters()} == {torch.bfloat16}
    assert engine.model_dir is None and engine.model_name == "random-tiny"


def test_the_same_seed_makes_the_same_model() -> None:
    first = random_checkpoint(TINY, device="cpu", dtype=torch.float32, seed=3).weights()
    again = random_checkpoint(TINY, device="cpu", dtype=torch.float32, seed=3).weights()
    other = random_checkpoint(TINY, device="cpu", dtype=torch.float32, seed=4).weights()
    for (name, tensor), (_, same), (_, different) in zip(first, again, other, strict=True):
        assert torch.equal(tensor, same), name
        assert not torch.equal(tensor, different), name
    assert greedy(seed=1, dtype="float32")[0] == greedy(seed=1, dtype="float32")[0]


def test_activations_stay_finite_through_a_deep_model() -> None:
    deep = TINY | {"num_hidden_layers": 24}
    checkpoint = random_checkpoint(deep, device="cpu", dtype=torch.bfloat16)
    engine = LLMEngine(EngineConfig(model=ModelConfig(model="random-deep", dtype="bfloat16", device="cpu"),
                                    cache=CacheConfig(block_size=4, num_blocks=64)), checkpoint=checkpoint)
    logits: list[torch.Tensor] = []
    compute_logits = engine.runner.model.compute_logits

    def recording(hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits.append(compute_logits(hidden, upcast))
        return logits[-1]

    engine.runner.model.compute_logits = recording  # type: ignore[method-assign]
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    assert all(bool(torch.isfinite(step).all()) and 0.1 < float(step.float().std()) < 100 for step in logits)
