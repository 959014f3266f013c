"""Qwen2 (and Qwen2.5): a Llama with biases on q/k/v (not on the output projection), whose layers
from `max_window_layers` on slide only where `use_sliding_window` is set (`layer_types`, where
written, says which layers)."""

from __future__ import annotations

from typing import Any

from cluster.model.architecture import ArchitectureConfig
from cluster.model.models.llama import llama_shaped_config, window_of_sliding_layers


def read_config(config: dict[str, Any]) -> ArchitectureConfig:
    return llama_shaped_config(config, qkv_bias=True, o_bias=False, sliding_window=sliding_window(config))


def sliding_window(config: dict[str, Any]) -> int | None:
    """The window as transformers' Qwen2 applies it."""
    if not config.get("use_sliding_window", False):
        return None
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = config.get("max_window_layers", 0)
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(config["num_hidden_layers"])]
    return window_of_sliding_layers(config.get("sliding_window"), layer_types)
