"""Mistral: a Llama whose every layer attends through `sliding_window` tokens, 4,096 where config.json
has no such key (MistralConfig's default; v0.2 and later write null), whatever `layer_types` says
(transformers' Mistral slides every layer). No bias anywhere."""

from __future__ import annotations

from typing import Any

from cluster.model.architecture import ArchitectureConfig
from cluster.model.models.llama import llama_shaped_config, windows_of_layers

DEFAULT_SLIDING_WINDOW = 4096


def read_config(config: dict[str, Any]) -> ArchitectureConfig:
    windows = windows_of_layers(config.get("sliding_window", DEFAULT_SLIDING_WINDOW), None, config["num_hidden_layers"])
    return llama_shaped_config(config, qkv_bias=False, o_bias=False, layer_windows=windows)
