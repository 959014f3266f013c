"""The model registry: which Hugging Face architectures the engine builds, and how it refuses others."""

from __future__ import annotations

import pytest

from cluster.model.models.llama import LlamaForCausalLM
from cluster.model.registry import architecture_config, model_class_for, supported_architectures

SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4}


def test_the_registry_lists_exactly_the_supported_architectures() -> None:
    assert sorted(supported_architectures()) == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                                 "Qwen3ForCausalLM"]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM"])
def test_every_supported_architecture_builds_the_llama_network(architecture: str) -> None:
    assert model_class_for(architecture) is LlamaForCausalLM
    assert architecture_config({**SHAPE, "architectures": [architecture]}).architecture == architecture


SUPPORTED = "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


def test_an_unknown_architecture_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=f"unsupported architecture 'GPT2LMHeadModel'; {SUPPORTED}"):
        architecture_config({**SHAPE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=f"unsupported architecture 'GPT2LMHeadModel'; {SUPPORTED}"):
        model_class_for("GPT2LMHeadModel")


def test_a_config_without_architectures_is_refused_by_its_model_type() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        architecture_config({**SHAPE, "model_type": "gpt2"})
