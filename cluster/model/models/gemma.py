"""Gemma 2 and Gemma 3 (text): the Llama network with Gemma's own layers, and their config readers.

What differs from Llama, as transformers' Gemma2/Gemma3 modules compute it:
- the embeddings are scaled by sqrt(hidden_size) (rounded to the model's dtype first);
- every RMSNorm scales by (1 + weight), and each layer has four: before and after the attention,
  before and after the MLP (`GemmaDecoderLayer`);
- the MLP is GeGLU: gelu(gate, tanh approximation) * up;
- scores are scaled by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps them
  (`attn_logit_softcapping`, in every attention path through `AttentionOptions`) and the final
  logits (`final_logit_softcapping`);
- layers alternate local (a sliding window) and global (the whole context) by `layer_types`, or the
  pattern where it is not written (Gemma 2: every other layer from the first; Gemma 3: five local to
  one global, `sliding_window_pattern`);
- Gemma 3 norms each query and key head (`q_norm`, `k_norm`, (1 + weight) too) and rotates its local
  layers with their own base (`rope_local_base_freq`, no scaling), its global ones with `rope_theta`
  and a linear scaling where set.
Embeddings are tied. Parameters keep Hugging Face names, q/k/v and gate/up fused as in Llama.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cluster.model import elementwise
from cluster.model.architecture import ArchitectureConfig
from cluster.model.attention.backend import AttentionBackend, AttentionMetadata
from cluster.model.models.llama import (
    MLP,
    Attention,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
    RotaryEmbedding,
    Rotation,
    llama_shaped_config,
    windows_of_layers,
)
from pdserve_kernels import reference

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
GEMMA3_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def read_gemma2_config(config: dict[str, Any]) -> ArchitectureConfig:
    """Gemma 2: one RoPE for every layer, soft caps on scores (50) and final logits (30) where set."""
    arch = gemma_shaped_config(config, default_pattern=2)
    return dataclasses.replace(arch, attn_logit_softcap=config.get("attn_logit_softcapping"),
                               final_logit_softcap=config.get("final_logit_softcapping"))


def read_gemma3_config(config: dict[str, Any]) -> ArchitectureConfig:
    """Gemma 3 (text): per-head q/k norms, a RoPE per layer type, soft caps only where a config sets them."""
    full, sliding = gemma3_rope(config)
    pattern = config.get("sliding_window_pattern", 6)
    arch = gemma_shaped_config({**config, "rope_parameters": full}, default_pattern=pattern)
    return dataclasses.replace(arch, qk_norm=True, sliding_rope_theta=sliding,
                               attn_logit_softcap=config.get("attn_logit_softcapping"),
                               final_logit_softcap=config.get("final_logit_softcapping"))


def gemma_shaped_config(config: dict[str, Any], *, default_pattern: int) -> ArchitectureConfig:
    """What Gemma 2 and 3 read alike. Refused: another activation than GeGLU's tanh gelu, and
    bidirectional attention (EmbeddingGemma)."""
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in GELU_TANH:
        raise ValueError(f"hidden activation {activation!r} is not supported: Gemma's MLP runs gelu_pytorch_tanh")
    if config.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported: decoders only")
    layers = config["num_hidden_layers"]
    # A pattern of n: every n-th layer (the n-th, the 2n-th, ...) global, the others local.
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % default_pattern else "full_attention" for i in range(layers)]
    windows = windows_of_layers(config.get("sliding_window"), layer_types, layers)
    arch = llama_shaped_config({**config, "tie_word_embeddings": config.get("tie_word_embeddings", True)},
                               qkv_bias=bool(config.get("attention_bias", False)),
                               o_bias=bool(config.get("attention_bias", False)), layer_windows=windows)
    return dataclasses.replace(arch, query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", arch.head_dim)))


def gemma3_rope(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(the global layers' RoPE parameters, the local layers' base). transformers 5 writes
    `rope_parameters` by layer type; earlier versions `rope_theta`, `rope_local_base_freq` and
    `rope_scaling` (the global layers') at the top level. A scaled local RoPE is refused."""
    by_type = config.get("rope_parameters") or {}
    if "full_attention" in by_type:
        full = dict(by_type["full_attention"])
        sliding = dict(by_type.get("sliding_attention") or {})
    else:
        full = {**(config.get("rope_scaling") or {}),
                "rope_theta": config.get("rope_theta", GEMMA3_DEFAULT_THETA["full_attention"])}
        sliding = {"rope_theta": config.get("rope_local_base_freq", GEMMA3_DEFAULT_THETA["sliding_attention"])}
    if sliding.get("rope_type", "default") != "default":
        raise ValueError(f"a scaled RoPE on the local layers ({sliding['rope_type']!r}) is not supported")
    full.setdefault("rope_theta", GEMMA3_DEFAULT_THETA["full_attention"])
    return full, float(sliding.get("rope_theta", GEMMA3_DEFAULT_THETA["sliding_attention"]))


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight): Gemma stores the weight's offset from 1 (zeros initialise it)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return elementwise.add_rms_norm(x, residual, (1.0 + self.weight.float()).to(x.dtype), self.eps)


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(reference.gelu_tanh_mul(self.gate_up_proj(x)))


@dataclass(frozen=True, slots=True)
class Rotations:
    """One step's rotations, looked up once: the global layers' and the local (sliding) layers'."""

    full: Rotation
    sliding: Rotation


class GemmaRotary(RotaryEmbedding):
    """The global layers' RoPE (this module's own tables) and, beside it, the local layers' (Gemma 3's
    `rope_local_base_freq`, unscaled; Gemma 2's local layers share the global one)."""

    def __init__(self, config: ArchitectureConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        theta = config.sliding_rope_theta
        local = dataclasses.replace(config, rope_theta=theta, rope_scaling=None) if theta is not None else None
        self.local = RotaryEmbedding(local, max_positions) if local is not None else None

    @torch.no_grad()
    def fill(self, dtype: torch.dtype) -> None:
        """Both tables: a model materialised from the meta device fills its rotary through this."""
        super().fill(dtype)
        local = self._modules.get("local")  # absent while RotaryEmbedding's constructor fills the global one
        if isinstance(local, RotaryEmbedding):
            local.fill(dtype)

    def both(self, positions: torch.Tensor) -> Rotations:
        full = self.at(positions)
        return Rotations(full, full if self.local is None else self.local.at(positions))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ArchitectureConfig, backend: AttentionBackend, layer: int) -> None:
        super().__init__()
        self.sliding = config.window_of(layer) is not None
        self.self_attn = Attention(config, backend, layer, norm=GemmaRMSNorm)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, rotations: Rotations) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's normed output, the residual stream before it), as Llama's layer: each residual add
        is fused with the norm after it. The attention's and the MLP's outputs are normed before the add."""
        normed, residual = self.input_layernorm(hidden, residual)
        rotation = rotations.sliding if self.sliding else rotations.full
        attended = self.post_attention_layernorm(self.self_attn(normed, kv_cache, metadata, rotation))[0]
        normed, residual = self.pre_feedforward_layernorm(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(normed))[0], residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 and Gemma 3 (text): Llama's interface and weight loading over Gemma's layers."""

    rotary: GemmaRotary

    def build_model(self, config: ArchitectureConfig, backend: AttentionBackend) -> LlamaModel:
        return LlamaModel(config, backend, GemmaDecoderLayer, GemmaRMSNorm)

    def build_rotary(self, config: ArchitectureConfig, max_positions: int) -> GemmaRotary:
        return GemmaRotary(config, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the model's dtype before the product, as transformers' normalizer is.
        hidden = hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)
        rotations = self.rotary.both(positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, kv_cache, metadata, rotations)
        return self.model.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """The lm head's logits, soft-capped where the model caps them (Gemma 2: 30)."""
        return reference.soft_cap(super().compute_logits(hidden, upcast), self.config.final_logit_softcap)
