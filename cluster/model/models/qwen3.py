"""Qwen3 (dense): a Llama whose attention RMS-normalizes each query and key head (`q_norm`, `k_norm`,
weights of head_dim) before the rotation, with `head_dim` written in its config (128, whatever the
hidden size), no biases unless `attention_bias`, and Qwen2's sliding-window settings."""

from __future__ import annotations

import dataclasses
from typing import Any

from cluster.model.architecture import ArchitectureConfig
from cluster.model.models import qwen2
from cluster.model.models.llama import llama_shaped_config


def read_config(config: dict[str, Any]) -> ArchitectureConfig:
    bias = bool(config.get("attention_bias", False))
    arch = llama_shaped_config(config, qkv_bias=bias, o_bias=bias, layer_windows=qwen2.layer_windows(config))
    return dataclasses.replace(arch, qk_norm=True)
