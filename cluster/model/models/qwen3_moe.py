"""Qwen3-MoE: Qwen3's attention (per-head query and key norms) with a sparse mixture of experts as the
MLP of the layers `decoder_sparse_step` and `mlp_only_layers` pick, and `MoeForCausalLM`, the
Llama-family decoder with such MLPs that Mixtral (`mixtral.py`) builds too.

A layer i is sparse where i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0
(with `num_experts` > 0), as transformers builds it; the others keep a dense MLP of
`intermediate_size`. The router softmaxes over `num_experts` (`num_local_experts` as transformers 5
writes it), keeps `num_experts_per_tok`, renormalized where `norm_topk_prob`; each expert is a SwiGLU
of `moe_intermediate_size`. Every layer slides `sliding_window` where `use_sliding_window` is set.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

import torch
from torch import nn

from cluster.model.architecture import ArchitectureConfig, MoeConfig
from cluster.model.models.llama import MLP, LlamaForCausalLM, llama_shaped_config, windows_of_layers
from cluster.model.moe import SparseMoeBlock


def read_config(config: dict[str, Any]) -> ArchitectureConfig:
    bias = bool(config.get("attention_bias", False))
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    arch = llama_shaped_config(config, qkv_bias=bias, o_bias=bias,
                               layer_windows=windows_of_layers(window, None, config["num_hidden_layers"]))
    return dataclasses.replace(arch, qk_norm=True, moe=MoeConfig(
        num_experts=number_of_experts(config),
        num_experts_per_tok=config.get("num_experts_per_tok", 8),
        intermediate_size=config["moe_intermediate_size"],
        renormalize=bool(config.get("norm_topk_prob", False)),
        sparse_layers=sparse_layers(config)))


def number_of_experts(config: dict[str, Any], default: int = 128) -> int:
    """`num_experts`, or `num_local_experts` (transformers 5 saves Qwen3-MoE's under Mixtral's name)."""
    return int(config.get("num_experts", config.get("num_local_experts", default)))


def sparse_layers(config: dict[str, Any]) -> tuple[int, ...]:
    dense = set(config.get("mlp_only_layers") or ())
    step = config.get("decoder_sparse_step", 1)
    if number_of_experts(config) == 0:
        return ()
    return tuple(i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


# A per-expert checkpoint tensor: (layer prefix, expert, projection). Mixtral's `block_sparse_moe`
# is renamed to `mlp` before matching.
EXPERT_TENSOR = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+)\.weight$")
# Projection names (Qwen3-MoE's, Mixtral's w1/w3/w2) -> (stacked parameter, shard: gate 0, up 1).
PROJECTIONS = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
               "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)}
SHARD_NAMES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class MoeForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` whose sparse layers (`ArchitectureConfig.moe`) take a `SparseMoeBlock` for
    their MLP. Loading maps each expert's checkpoint tensors (`mlp.experts.<e>.gate_proj`, `up_proj`,
    `down_proj`; Mixtral's `block_sparse_moe.experts.<e>.w1`, `w3`, `w2`) onto slices of the stacked
    parameters, and names any expert tensor missing in Qwen3-MoE's terms."""

    def mlp_of_layer(self, index: int) -> nn.Module:
        moe = self.config.moe
        if moe is None or index not in moe.sparse_layers:
            return MLP(self.config)
        return SparseMoeBlock(self.config.hidden_size, moe)

    def _destination(self, name: str, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor, list[str]]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name in params and ".mlp.experts." in name:  # stored stacked: every expert's shards at once
            return params[name], self._shards_of(name)
        match = EXPERT_TENSOR.match(name)
        if match is None:
            return super()._destination(name, params)
        layer, expert, projection = match[1], int(match[2]), match[3]
        stacked, shard = PROJECTIONS.get(projection, ("", 0))
        target = f"{layer}.experts.{stacked}"
        if target not in params or expert >= params[target].shape[0]:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of this model")
        rows = params[target].shape[1] // len(SHARD_NAMES[stacked])
        destination = params[target][expert].narrow(0, shard * rows, rows)
        return destination, [f"{layer}.experts.{expert}.{SHARD_NAMES[stacked][shard]}.weight"]

    def _shards_of(self, name: str) -> list[str]:
        layer, _, stacked = name.rpartition(".experts.")
        if ".mlp.experts." not in name or stacked not in SHARD_NAMES:
            return super()._shards_of(name)
        experts = range(self.config.moe.num_experts if self.config.moe else 0)
        return [f"{layer}.experts.{expert}.{part}.weight"
                for expert, part in itertools.product(experts, SHARD_NAMES[stacked])]
