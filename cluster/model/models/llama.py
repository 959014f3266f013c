"""A Llama-architecture decoder over the paged KV cache (Llama 1-3, SmolLM; Mistral, Qwen2, Qwen3 and
Phi-3 build it too, with their own config readers in `mistral.py`, `qwen2.py`, `qwen3.py` and
`phi3.py`; Qwen3's per-head query and key norms are `Attention.q_norm`, `k_norm`), and Llama's
config reader.

Inputs are flat: every token of the step in one row ([tokens]), whatever request it belongs to.
Parameters keep Hugging Face names except two fusions that save matmuls: q/k/v become `qkv_proj`
and gate/up become `gate_up_proj`; `load_weights` maps checkpoint names onto them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cluster.model import elementwise
from cluster.model.architecture import ArchitectureConfig
from cluster.model.attention.backend import AttentionBackend, AttentionMetadata
from pdserve_kernels import reference
from pdserve_kernels.reference import AttentionOptions


def read_config(config: dict[str, Any]) -> ArchitectureConfig:
    """Llama's config.json (Llama 1-3, SmolLM): `attention_bias` biases q/k/v and the output projection;
    no layer slides whatever `sliding_window` says (transformers' Llama has none)."""
    bias = bool(config.get("attention_bias", False))
    return llama_shaped_config(config, qkv_bias=bias, o_bias=bias, layer_windows=())


def llama_shaped_config(config: dict[str, Any], *, qkv_bias: bool, o_bias: bool,
                        layer_windows: tuple[int | None, ...]) -> ArchitectureConfig:
    """The fields every Llama-shaped config.json writes alike, with the ones its architecture decides.
    Refuses what this forward pass does not implement (`mlp_bias`, RoPE scalings other than linear and
    Llama 3's)."""
    heads = config["num_attention_heads"]
    # transformers 5 keeps rope settings under rope_parameters; earlier versions at the top level.
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if config.get("mlp_bias"):
        raise ValueError("mlp_bias=True checkpoints are not supported")
    if rope_type not in ("default", "llama3", "linear"):
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: default, linear, llama3")
    return ArchitectureConfig(
        architecture=config["architectures"][0],
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        layer_windows=layer_windows,
    )


def windows_of_layers(window: int | None, layer_types: list[str] | None, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window: `window` on the layers `layer_types` calls "sliding_attention" (every layer
    where it is not written), None on the others; empty where no layer slides."""
    types = layer_types or ["sliding_attention"] * num_layers
    windows = tuple(int(window) if window is not None and kind == "sliding_attention" else None for kind in types)
    return windows if any(w is not None for w in windows) else ()


def rope_inverse_frequencies(config: ArchitectureConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > original / low, inv_freq / factor,
                       torch.where(wavelen < original / high, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """Hugging Face's (non-interleaved) rotary layout, with cos/sin precomputed per position."""

    def __init__(self, config: ArchitectureConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(max_positions, config.head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, config.head_dim // 2), persistent=False)
        self.fill(torch.float32)

    cos: torch.Tensor
    sin: torch.Tensor

    @torch.no_grad()
    def fill(self, dtype: torch.dtype) -> None:
        """Compute the tables in place, in fp32 on their device, rounded through the weights' `dtype`:
        transformers rotates with cos and sin in the model's dtype. Also what fills them after the model
        is materialised from the meta device (`build_model`)."""
        if self.cos.is_meta:
            return
        positions = torch.arange(self.cos.shape[0], dtype=torch.float64)
        freqs = torch.outer(positions, rope_inverse_frequencies(self.config)).to(self.cos.device)
        self.cos = freqs.cos().to(dtype).float()
        self.sin = freqs.sin().to(dtype).float()

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotation of one step's tokens, looked up once for every layer."""
        return Rotation(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotation = self.at(positions)
        return rotation.rotate(query), rotation.rotate(key)


@dataclass(frozen=True, slots=True)
class Rotation:
    cos: torch.Tensor  # [tokens, 1, head_dim / 2] float32
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, heads, head_dim] rotated per token, computed in float32, returned in x's dtype."""
        return reference.rotary(x, self.cos, self.sin)

    def rotate_heads(self, qkv: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """The first `heads` heads of each row of qkv [tokens, ...] rotated: [tokens, heads, head_dim]."""
        return elementwise.rotate_heads(qkv, heads, head_dim, self.cos, self.sin)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused with the norm after it."""
        return elementwise.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ArchitectureConfig, backend: AttentionBackend, layer: int,
                 norm: type[RMSNorm] = RMSNorm) -> None:
        """Layer `layer`'s attention: its sliding window, if any, and the soft cap on its scores;
        `norm` the class of the per-head query and key norms (Gemma's scale by 1 + weight)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.backend = backend
        self.options = AttentionOptions(window=config.window_of(layer), softcap=config.attn_logit_softcap)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                rotation: Rotation) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is not None and self.k_norm is not None:
            query = rotation.rotate(self._per_head(self.q_norm, qkv[:, :self.q_size], heads))
            key = rotation.rotate(self._per_head(self.k_norm, qkv[:, self.q_size:self.q_size + self.kv_size], kv_heads))
        else:
            # Queries and keys side by side in each row of qkv: rotated together, in one set of ops.
            rotated = rotation.rotate_heads(qkv, heads + kv_heads, dim)
            query, key = rotated.split([heads, kv_heads], dim=1)
        value = qkv[:, self.q_size + self.kv_size:].view(-1, kv_heads, dim)
        out = self.backend.forward(query, key, value, kv_cache, metadata, self.scale, self.options)
        return self.o_proj(out.reshape(-1, self.q_size))


    def _per_head(self, norm: RMSNorm, x: torch.Tensor, heads: int) -> torch.Tensor:
        """`norm` over each head of x [tokens, heads * head_dim]: [tokens, heads, head_dim]."""
        return norm(x.reshape(-1, self.head_dim))[0].view(-1, heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, config: ArchitectureConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(elementwise.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Attention, then an MLP: the dense `MLP` unless `mlp` is given (whatever maps [tokens, hidden] to
    [tokens, hidden]: a mixture of experts, `cluster.model.moe.SparseMoeBlock`)."""

    def __init__(self, config: ArchitectureConfig, backend: AttentionBackend, layer: int,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, backend, layer)
        self.mlp = mlp if mlp is not None else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, rotation: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output, the residual stream before it): the next layer's norm adds the two, so each
        residual add is fused with the norm after it. `residual` None: `hidden` is the stream itself."""
        normed, residual = self.input_layernorm(hidden, residual)
        attended = self.self_attn(normed, kv_cache, metadata, rotation)
        normed, residual = self.post_attention_layernorm(attended, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    """The embeddings, the decoder layers (of `layer_class`: Gemma's differ) and the final norm."""

    def __init__(self, config: ArchitectureConfig, backend: AttentionBackend,
                 layer_class: Callable[[ArchitectureConfig, AttentionBackend, int], nn.Module] = DecoderLayer,
                 norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_class(config, backend, layer) for layer in range(config.num_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


# Checkpoint name fragments that load into a slice of a fused parameter: (fused name, shard index).
FUSED_SHARDS = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ArchitectureConfig, backend: AttentionBackend, max_positions: int) -> None:
        """Built on the meta device by the runner (`build_model`), then allocated in the serving dtype."""
        super().__init__()
        self.config = config
        self.model = self.build_model(config, backend)
        self.rotary = self.build_rotary(config, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(self, config: ArchitectureConfig, backend: AttentionBackend) -> LlamaModel:
        """The network under the lm head: a subclass's own layers go here (`gemma.py`), its own MLPs in
        `mlp_of_layer` (`qwen3_moe.py`)."""
        return LlamaModel(config, backend, lambda c, b, layer: DecoderLayer(c, b, layer, self.mlp_of_layer(layer)))

    def build_rotary(self, config: ArchitectureConfig, max_positions: int) -> RotaryEmbedding:
        return RotaryEmbedding(config, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states of every token of the step: [tokens, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        rotation = self.rotary.at(positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, kv_cache, metadata, rotation)
        return self.model.norm(hidden, residual)[0]

    def mlp_of_layer(self, index: int) -> nn.Module:
        """The MLP layer `index` builds (a subclass's may differ by layer)."""
        return MLP(self.config)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """The lm_head's logits, widened to fp32 unless `upcast` is False (the sampler widens what it
        needs: every consumer of the bf16 logits sees what the fp32 copy holds, exactly)."""
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    def shard_sizes(self, fused: str) -> list[int]:
        config = self.config
        if fused == ".qkv_proj.":
            kv = config.num_kv_heads * config.head_dim
            return [config.num_heads * config.head_dim, kv, kv]
        return [config.intermediate_size, config.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in; fails naming any parameter left unloaded or name not known."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            destination, shards = self._destination(name, params)
            if destination.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(destination.shape)}")
            destination.copy_(tensor)
            loaded.update(shards)
        self._check_all_loaded(params, loaded)

    def _destination(self, name: str, params: dict[str, nn.Parameter]) -> tuple[torch.Tensor, list[str]]:
        """The parameter, or the slice of one, that checkpoint tensor `name` loads into, and the shards
        (`_shards_of`'s keys) it fills."""
        target, offset, size = self._locate(name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of this model")
        destination = params[target].narrow(0, offset, size) if size else params[target]
        return destination, self._shards_loaded(target, offset, size)

    def _shards_loaded(self, target: str, offset: int, size: int) -> list[str]:
        """What a tensor loaded: its shard of a fused parameter, or all of them when it was stored fused
        (Phi-3's `qkv_proj`, `gate_up_proj`)."""
        fused = next((f for f in (".qkv_proj.", ".gate_up_proj.") if f in target), None)
        if size or fused is None:
            return [f"{target}#{offset}"]
        sizes = self.shard_sizes(fused)
        return [f"{target}#{sum(sizes[:i])}" for i in range(len(sizes))]

    def _locate(self, name: str) -> tuple[str, int, int]:
        """(parameter name, row offset, rows) a checkpoint tensor loads into; rows 0 = all of it."""
        for fragment, (fused, shard) in FUSED_SHARDS.items():
            if fragment in name:
                sizes = self.shard_sizes(fused)
                return name.replace(fragment, fused), sum(sizes[:shard]), sizes[shard]
        return name, 0, 0

    def _shards_of(self, name: str) -> list[str]:
        """The keys a parameter's loading must fill: one per shard of a fused parameter, else one.
        Reported missing up to their `#`."""
        fused = next((f for f in (".qkv_proj.", ".gate_up_proj.") if f in name), None)
        sizes = self.shard_sizes(fused) if fused else [0]
        return [f"{name}#{sum(sizes[:i])}" for i in range(len(sizes))]

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = [shard for name in params for shard in self._shards_of(name) if shard not in loaded]
        if missing:
            names = sorted({shard.split("#")[0] for shard in missing})
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {names[:5]}")
