"""Qwen2 (and Qwen2.5): a Llama with biases on q/k/v (not on the output projection), whose layers
from `max_window_layers` on slide only where `use_sliding_window` is set (`layer_types`, where
written, says which layers)."""

from __future__ import annotations

from typing import Any

from cluster.model.architecture import ArchitectureConfig
from cluster.model.models.llama import llama_shaped_config, windows_of_layers


def read_config(config: dict[str, Any]) -> ArchitectureConfig:
    return llama_shaped_config(config, qkv_bias=True, o_bias=False, layer_windows=layer_windows(config))


def layer_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window as transformers' Qwen2 applies it: none without `use_sliding_window`."""
    if not config.get("use_sliding_window", False):
        return ()
    layer_types = config.get("layer_types")
    if layer_types is None:
        first = config.get("max_window_layers", 0)
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(config["num_hidden_layers"])]
    return windows_of_layers(config.get("sliding_window"), layer_types, config["num_hidden_layers"])
