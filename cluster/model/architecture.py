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
    # The attention window of the layers that slide (Mistral 7B v0.1's 4,096), None where every layer
    # attends to its whole context. The engine attends to the whole context: it refuses a context
    # longer than the window (`LLMEngine`), where the answers would no longer be the model's.
    sliding_window: int | None = None
    # Qwen3: queries and keys RMS-normalized per head (weights of head_dim) before the rotation.
    qk_norm: bool = False
    # Mixture-of-experts models: which layers' MLPs are sparse and how they route; None for dense ones.
    moe: MoeConfig | None = None
