"""Phi-3 (mini, medium): a Llama whose checkpoints store q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` (the fused parameters load whole), without biases, every layer sliding
`sliding_window` tokens where it is set (Phi-3-mini-4k: 2,047). Refused: a rotation over part of each
head (`partial_rotary_factor` below 1, Phi-4-mini) and LongRoPE scaling (the 128k variants)."""

from __future__ import annotations

from typing import Any

from cluster.model.architecture import ArchitectureConfig
from cluster.model.models.llama import llama_shaped_config, windows_of_layers


def read_config(config: dict[str, Any]) -> ArchitectureConfig:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial is not None and partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported: the rotation spans every head's width")
    windows = windows_of_layers(config.get("sliding_window"), None, config["num_hidden_layers"])
    return llama_shaped_config(config, qkv_bias=False, o_bias=False, layer_windows=windows)
