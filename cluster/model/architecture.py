"""`ArchitectureConfig`: what the forward pass reads of a checkpoint's config.json, whatever the
architecture. Each architecture's module (`cluster/model/models/`) reads its own quirks into it;
`cluster.model.registry.architecture_config` picks that reader by the `architectures` name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's
    `num_experts_per_tok` experts of `num_experts` by softmax probability; their SwiGLU outputs
    (each `intermediate_size` wide) are summed weighted by those probabilities, renormalized to sum to
    1 where `renormalize`. The layers of `sparse_layers` have one; the others keep the dense MLP."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ArchitectureConfig:
    architecture: str  # the Hugging Face name (config.json's `architectures[0]`): the registry's key
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    # Each layer's sliding window (Mistral 7B v0.1's 4,096 on every layer, Qwen2's upper layers where it
    # slides them), None for a layer that attends to its whole context; empty where no layer slides.
    # A query sees itself and the window - 1 tokens before it (transformers' sliding mask).
    layer_windows: tuple[int | None, ...] = ()
    # Qwen3, Gemma 3: queries and keys RMS-normalized per head (weights of head_dim) before the rotation.
    qk_norm: bool = False
    # Mixture-of-experts models: which layers' MLPs are sparse and how they route; None for dense ones.
    moe: MoeConfig | None = None
    # Gemma: scores scaled by query_pre_attn_scalar ** -0.5 rather than head_dim's.
    query_pre_attn_scalar: float | None = None
    # Gemma 2: scores (after the scale) soft-capped, cap * tanh(score / cap), and so are the final logits.
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Gemma 3: the RoPE base of the sliding layers (no scaling), apart from the full layers' rope_theta.
    sliding_rope_theta: float | None = None

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None where it sees its whole context."""
        return self.layer_windows[layer] if self.layer_windows else None
