"""Mixtral: Mistral's attention with every layer's MLP a sparse mixture of experts (`block_sparse_moe`
in the checkpoint, experts' `w1`, `w3`, `w2` for gate, up and down): top `num_experts_per_tok` (2)
of `num_local_experts` (8), always renormalized, each expert `intermediate_size` wide. Every layer
slides `sliding_window` where it is set (MixtralConfig's default is none). Builds
`qwen3_moe.MoeForCausalLM`."""

from __future__ import annotations

import dataclasses
from typing import Any

from cluster.model.architecture import ArchitectureConfig, MoeConfig
from cluster.model.models.llama import llama_shaped_config, windows_of_layers


def read_config(config: dict[str, Any]) -> ArchitectureConfig:
    windows = windows_of_layers(config.get("sliding_window"), config.get("layer_types"), config["num_hidden_layers"])
    arch = llama_shaped_config(config, qkv_bias=False, o_bias=False, layer_windows=windows)
    return dataclasses.replace(arch, moe=MoeConfig(
        num_experts=int(config.get("num_local_experts", config.get("num_experts", 8))),
        num_experts_per_tok=config.get("num_experts_per_tok", 2),
        intermediate_size=config["intermediate_size"],
        renormalize=True,
        sparse_layers=tuple(range(config["num_hidden_layers"]))))
