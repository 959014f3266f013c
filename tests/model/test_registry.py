"""The model registry: which Hugging Face architectures the engine builds, and how it refuses others."""

from __future__ import annotations

import pytest

from cluster.model.architecture import MoeConfig
from cluster.model.models.gemma import GemmaForCausalLM
from cluster.model.models.llama import LlamaForCausalLM
from cluster.model.models.qwen3_moe import MoeForCausalLM
from cluster.model.registry import architecture_config, model_class_for, supported_architectures

SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4}


def test_the_registry_lists_exactly_the_supported_architectures() -> None:
    assert sorted(supported_architectures()) == ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM",
                                                 "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM",
                                                 "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM", "Phi3ForCausalLM"])
def test_every_supported_architecture_builds_the_llama_network(architecture: str) -> None:
    assert model_class_for(architecture) is LlamaForCausalLM
    arch = architecture_config({**SHAPE, "architectures": [architecture]})
    assert arch.architecture == architecture and arch.moe is None


QWEN3_MOE = {**SHAPE, "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 6, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize(("config", "moe"), [
    # transformers' defaults: every layer sparse, the top-k weights as the softmax gave them
    (QWEN3_MOE, MoeConfig(8, 2, 32, renormalize=False, sparse_layers=(0, 1, 2, 3, 4, 5))),
    # layer i sparse where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers
    ({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [1], "norm_topk_prob": True},
     MoeConfig(8, 2, 32, renormalize=True, sparse_layers=(3, 5))),
    # transformers 5 writes the number of experts as num_local_experts
    ({**{k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}, "num_local_experts": 4},
     MoeConfig(4, 2, 32, renormalize=False, sparse_layers=(0, 1, 2, 3, 4, 5))),
    ({**QWEN3_MOE, "num_experts": 0}, MoeConfig(0, 2, 32, renormalize=False, sparse_layers=())),
    # Mixtral: every layer sparse, renormalized, experts as wide as intermediate_size
    ({**SHAPE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2},
     MoeConfig(8, 2, 128, renormalize=True, sparse_layers=(0, 1))),
], ids=["qwen3-moe-defaults", "qwen3-moe-sparse-step-mlp-only", "qwen3-moe-num-local-experts",
        "qwen3-moe-no-experts", "mixtral"])
def test_mixture_of_experts_configs_are_read_as_transformers_builds_them(config: dict, moe: MoeConfig) -> None:
    arch = architecture_config(config)
    assert model_class_for(arch.architecture) is MoeForCausalLM
    assert arch.moe == moe


@pytest.mark.parametrize(("config", "window"), [
    (QWEN3_MOE, None),  # use_sliding_window absent: transformers' Qwen3-MoE drops the window
    ({**QWEN3_MOE, "sliding_window": 64, "use_sliding_window": True}, 64),  # every layer slides
    ({**SHAPE, "architectures": ["MixtralForCausalLM"]}, None),  # MixtralConfig's default is no window
    ({**SHAPE, "architectures": ["MixtralForCausalLM"], "sliding_window": 4096}, 4096),
])
def test_mixture_of_experts_windows_are_read_as_transformers_applies_them(config: dict, window: int | None) -> None:
    arch = architecture_config(config)
    assert {arch.window_of(layer) for layer in range(arch.num_layers)} == {window}


def test_qwen3_moe_keeps_qwen3_per_head_norms() -> None:
    assert architecture_config(QWEN3_MOE).qk_norm


@pytest.mark.parametrize("architecture", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_gemma_builds_its_own_layers_over_the_llama_network(architecture: str) -> None:
    assert model_class_for(architecture) is GemmaForCausalLM and issubclass(GemmaForCausalLM, LlamaForCausalLM)
    assert architecture_config({**SHAPE, "architectures": [architecture]}).architecture == architecture


SUPPORTED = ("supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
             "Qwen3MoeForCausalLM, MixtralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM")


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
