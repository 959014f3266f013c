"""The model registry: which Hugging Face architectures the engine builds, and how it refuses others."""

from __future__ import annotations

import pytest

from cluster.model.models.gemma import GemmaForCausalLM
from cluster.model.models.llama import LlamaForCausalLM
from cluster.model.registry import architecture_config, model_class_for, supported_architectures

SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4}


def test_the_registry_lists_exactly_the_supported_architectures() -> None:
    assert sorted(supported_architectures()) == ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM",
                                                 "MistralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
                                                 "Qwen3ForCausalLM"]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM", "Phi3ForCausalLM"])
def test_every_supported_architecture_builds_the_llama_network(architecture: str) -> None:
    assert model_class_for(architecture) is LlamaForCausalLM
    assert architecture_config({**SHAPE, "architectures": [architecture]}).architecture == architecture


@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_gemma_builds_its_own_layers_over_the_llama_network(architecture: str) -> None:
    assert model_class_for(architecture) is GemmaForCausalLM and issubclass(GemmaForCausalLM, LlamaForCausalLM)
    assert architecture_config({**SHAPE, "architectures": [architecture]}).architecture == architecture


SUPPORTED = ("supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
             "Gemma2ForCausalLM, Gemma3ForCausalLM")


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


GEMMA = {**SHAPE, "num_hidden_layers": 6, "head_dim": 16, "sliding_window": 512}


@pytest.mark.parametrize(("config", "windows"), [
    ({"architectures": ["Gemma2ForCausalLM"]}, (512, None) * 3),  # every other layer global, from the second
    ({"architectures": ["Gemma3ForCausalLM"]}, (512,) * 5 + (None,)),  # five local to one global
    ({"architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 3}, (512, 512, None) * 2),
    ({"architectures": ["Gemma3ForCausalLM"], "layer_types": ["full_attention"] * 6}, ()),
], ids=["gemma2-pattern", "gemma3-pattern", "gemma3-pattern-3", "gemma3-layer-types"])
def test_gemma_layers_slide_by_layer_types_or_the_pattern(config: dict, windows: tuple[int | None, ...]) -> None:
    assert architecture_config({**GEMMA, **config}).layer_windows == windows


def test_gemma3_reads_the_rope_of_each_layer_type_in_either_layout() -> None:
    """transformers 5 writes `rope_parameters` by layer type; earlier config.json files the global theta,
    the local base (`rope_local_base_freq`) and the global scaling at the top level."""
    scaling = {"rope_type": "linear", "factor": 8.0}
    old = {**GEMMA, "architectures": ["Gemma3ForCausalLM"], "rope_theta": 1e6, "rope_local_base_freq": 1e4,
           "rope_scaling": scaling}
    by_type = {"full_attention": {**scaling, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    new = {**GEMMA, "architectures": ["Gemma3ForCausalLM"], "rope_parameters": by_type}
    for config in (old, new):
        arch = architecture_config(config)
        assert (arch.rope_theta, arch.sliding_rope_theta) == (1e6, 1e4)
        assert arch.rope_scaling == {**scaling, "rope_theta": 1e6}
        assert arch.qk_norm and arch.tie_word_embeddings and arch.query_pre_attn_scalar == 16


@pytest.mark.parametrize(("config", "message"), [
    ({"hidden_activation": "gelu"}, "hidden activation 'gelu' is not supported"),
    ({"use_bidirectional_attention": True}, "bidirectional attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}}, "scaled RoPE on the local"),
])
def test_gemma_settings_this_forward_pass_lacks_are_refused(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        architecture_config({**GEMMA, "architectures": ["Gemma3ForCausalLM"], **config})
