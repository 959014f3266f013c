"""The model registry: which Hugging Face architectures the engine builds, and how it refuses others."""

from __future__ import annotations

import pytest

from cluster.model.models.llama import LlamaForCausalLM
from cluster.model.registry import architecture_config, model_class_for, supported_architectures

SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4}


def test_the_registry_lists_exactly_the_supported_architectures() -> None:
    assert sorted(supported_architectures()) == ["LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
                                                 "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM", "Phi3ForCausalLM"])
def test_every_supported_architecture_builds_the_llama_network(architecture: str) -> None:
    assert model_class_for(architecture) is LlamaForCausalLM
    assert architecture_config({**SHAPE, "architectures": [architecture]}).architecture == architecture


SUPPORTED = "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM"


def test_an_unknown_architecture_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=f"unsupported architecture 'GPT2LMHeadModel'; {SUPPORTED}"):
        architecture_config({**SHAPE, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=f"unsupported architecture 'GPT2LMHeadModel'; {SUPPORTED}"):
        model_class_for("GPT2LMHeadModel")


def test_a_config_without_architectures_is_refused_by_its_model_type() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        architecture_config({**SHAPE, "model_type": "gpt2"})


@pytest.mark.parametrize(("extra", "refusal"), [
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor 0.5"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [4.0]}}, "unsupported rope scaling"),
])
def test_phi3_variants_this_forward_pass_does_not_compute_are_refused(extra: dict, refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        architecture_config({**SHAPE, "architectures": ["Phi3ForCausalLM"], **extra})
    assert architecture_config({**SHAPE, "architectures": ["Phi3ForCausalLM"], "sliding_window": 2047}
                               ).layer_windows == (2047, 2047)
