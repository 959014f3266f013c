"""Builders shared by the tests: tiny random-weight checkpoints, engines and requests."""

from __future__ import annotations

from pathlib import Path

import torch


def build_random_llama(path: Path, *, architecture: str = "llama", num_layers: int = 2, hidden_size: int = 64,
                       num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 320, qkv_bias: bool = False,
                       tie_word_embeddings: bool = False, rope_scaling: dict | None = None, seed: int = 0,
                       max_position_embeddings: int = 512) -> Path:
    """Save a random-weight Llama (or Qwen2, which biases q/k/v) with transformers, as safetensors."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if architecture == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        if rope_scaling is not None:
            common["rope_scaling"] = rope_scaling
        config = transformers.LlamaConfig(**common, attention_bias=qkv_bias)
        model = transformers.LlamaForCausalLM(config)
    # Random init leaves tiny logits; larger weights make the comparison meaningful.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.2)
            elif "norm" in name:
                parameter.normal_(1, 0.1)
            else:
                parameter.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path
