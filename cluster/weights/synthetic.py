"""Small random-weight checkpoints, complete with a tokenizer and a chat template, built in seconds:
what the tests and benchmarks run on where the default model's text does not matter (as vLLM's
dummy loader, product code so that benchmarks need not import the tests). transformers writes the
weights, so the files are what a real Hugging Face checkpoint directory holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def build_random_llama(path: Path, *, architecture: str = "llama", num_layers: int = 2, hidden_size: int = 64,  # noqa: PLR0913
                       num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 320, qkv_bias: bool = False,
                       tie_word_embeddings: bool = False, rope_scaling: dict | None = None, seed: int = 0,
                       max_position_embeddings: int = 512, sliding_window: int | None = None,
                       head_dim: int | None = None, extra_config: dict[str, Any] | None = None) -> Path:
    """Save a random-weight Llama (or Qwen2, which biases q/k/v and, given `sliding_window`, slides it on
    its upper half of layers only, Qwen3, which norms each query and key head and may set `head_dim`
    apart from the hidden size, Phi-3, which stores q/k/v and gate/up fused, or Mistral, whose layers
    attend through `sliding_window` tokens where it is set, or Gemma 2 and Gemma 3, whose local layers
    slide `sliding_window`) with transformers, as safetensors. `extra_config`: more of the config's
    fields (Gemma's soft caps, layer types, RoPE parameters)."""
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    common |= extra_config or {}
    config: Any
    model: Any
    if architecture in ("gemma2", "gemma3"):
        config, model = _gemma(architecture, common, head_dim or hidden_size // num_heads, sliding_window)
    elif architecture == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=sliding_window is not None,
                                          sliding_window=sliding_window, max_window_layers=num_layers // 2)
        model = transformers.Qwen2ForCausalLM(config)
    elif architecture == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=head_dim or hidden_size // num_heads)
        model = transformers.Qwen3ForCausalLM(config)
    elif architecture == "phi3":
        config = transformers.Phi3Config(**common, sliding_window=sliding_window, pad_token_id=0)
        model = transformers.Phi3ForCausalLM(config)
    elif architecture == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=sliding_window)
        model = transformers.MistralForCausalLM(config)
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


def _gemma(architecture: str, common: dict[str, Any], head_dim: int, sliding_window: int | None) -> tuple[Any, Any]:
    """A Gemma 2 or Gemma 3 (text) config and model; Gemma's activation, its head_dim as the query scalar."""
    import transformers

    fields = dict(common, head_dim=head_dim, sliding_window=sliding_window or 4096,
                  hidden_activation="gelu_pytorch_tanh")
    fields.setdefault("query_pre_attn_scalar", head_dim)
    if architecture == "gemma2":
        gemma2 = transformers.Gemma2Config(**fields)
        return gemma2, transformers.Gemma2ForCausalLM(gemma2)
    gemma3 = transformers.Gemma3TextConfig(**fields)
    return gemma3, transformers.Gemma3ForCausalLM(gemma3)


# ChatML over several lines, so that rendering depends on trim_blocks/lstrip_blocks as in transformers.
CHATML_TEMPLATE = """{% for message in messages %}
{% if message['role'] not in ['system', 'user', 'assistant'] %}
{{ raise_exception('unknown role: ' + message['role']) }}
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


# Ids 0, 1, 2 as in SmolLM2: unk, bos and eos (which also ends a chat turn).
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


_TINY_CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. What is the capital of Spain?",
    "Hello world! Hello there, how are you doing today? I am fine, thank you.",
    "def main():\n    print('hello')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 2024 3.14159",
    "Emoji: 😀 🎉 👍🏽 and CJK: 中文 日本語 한국어, accents: café naïve über",
    "the quick brown fox jumps over the lazy dog; THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG",
)


def build_tiny_tokenizer(path: Path, *, vocab_size: int = 320, add_bos_token: bool = False,
                         chat_template: str | None = CHATML_TEMPLATE, template_file: bool = False) -> Path:
    """Train a byte-level BPE (GPT-2/SmolLM2 style) of at most `vocab_size` ids into `path`, in seconds.

    Writes tokenizer.json and tokenizer_config.json (+ chat_template.jinja when `template_file`, as
    transformers 5 saves it). `add_bos_token` puts <|im_start|> (id 1) first through tokenizer.json's
    post-processor, as Llama 3 checkpoints do. Byte-level: any text encodes, and characters outside
    the tiny corpus split into single-byte tokens, which exercises UTF-8 handling.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(TINY_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(_TINY_CORPUS) * 4, trainer=trainer)
    bos = TINY_SPECIAL_TOKENS[1]
    single = f"{bos}:0 $A:0" if add_bos_token else "$A:0"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=f"{single} $B:1", special_tokens=[(bos, 1)] if add_bos_token else [])
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                    "eos_token": TINY_SPECIAL_TOKENS[2], "unk_token": TINY_SPECIAL_TOKENS[0],
                    "pad_token": TINY_SPECIAL_TOKENS[2], "model_max_length": 512}
    if chat_template is not None and template_file:
        (path / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    elif chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


def build_tiny_llama_checkpoint(path: Path, *, num_layers: int = 2, hidden: int = 64,  # noqa: PLR0913
                                heads: int = 4, kv_heads: int = 2, vocab: int = 320, qkv_bias: bool = False,
                                tie: bool = False, seed: int = 0, add_bos_token: bool = False,
                                architecture: str | None = None, sliding_window: int | None = None) -> Path:
    """A complete random-weight checkpoint directory: `build_random_llama` weights plus a tiny tokenizer.

    `qkv_bias=True` makes it a Qwen2ForCausalLM (biases on q/k/v only), `architecture="mistral"` a
    MistralForCausalLM (with `sliding_window`, if given). bos/eos ids 1 and 2 agree between
    config.json, generation_config.json and the tokenizer.
    """
    build_random_llama(path, architecture=architecture or ("qwen2" if qkv_bias else "llama"), num_layers=num_layers,
                       hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, vocab_size=vocab,
                       tie_word_embeddings=tie, seed=seed, sliding_window=sliding_window)
    return build_tiny_tokenizer(path, vocab_size=vocab, add_bos_token=add_bos_token)

