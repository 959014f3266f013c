"""Small random-weight checkpoints, complete with a tokenizer and a chat template, built in seconds:
what the tests and benchmarks run on where the default model's text does not matter (as vLLM's
dummy loader, product code so that benchmarks need not import the tests). transformers writes the
weights, so the files are what a real Hugging Face checkpoint directory holds.

`random_checkpoint` is the in-memory kind, for real shapes (an 8B model): no file, the weights made
on the device in the serving dtype one tensor at a time as the engine loads them."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from cluster.weights.loader import Checkpoint
from cluster.weights.tokenizer import Tokenizer


def build_random_llama(path: Path, *, architecture: str = "llama", num_layers: int = 2, hidden_size: int = 64,  # noqa: PLR0913
                       num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 320, qkv_bias: bool = False,
                       tie_word_embeddings: bool = False, rope_scaling: dict | None = None, seed: int = 0,
                       max_position_embeddings: int = 512, sliding_window: int | None = None,
                       head_dim: int | None = None, moe: dict[str, Any] | None = None,
                       extra_config: dict[str, Any] | None = None) -> Path:
    """Save a random-weight Llama (or Qwen2, which biases q/k/v and, given `sliding_window`, slides it on
    its upper half of layers only, Qwen3, which norms each query and key head and may set `head_dim`
    apart from the hidden size, Phi-3, which stores q/k/v and gate/up fused, Mistral, whose layers
    attend through `sliding_window` tokens where it is set, Gemma 2 and Gemma 3, whose local layers
    slide `sliding_window`, or the mixtures of experts Qwen3-MoE and Mixtral, with `moe`'s settings over
    4 experts, top-2) with transformers, as safetensors. `moe` holds the transformers config keys of
    the experts (`num_experts` or `num_local_experts`, `num_experts_per_tok`, `norm_topk_prob`,
    `mlp_only_layers`, ...); `extra_config`: more of the config's fields (Gemma's soft caps, layer
    types, RoPE parameters)."""
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
    elif architecture == "qwen3_moe":
        experts = {"head_dim": head_dim or hidden_size // num_heads, "moe_intermediate_size": hidden_size // 2,
                   "num_experts": 4, "num_experts_per_tok": 2, **(moe or {})}
        config = transformers.Qwen3MoeConfig(**common, **experts)
        model = transformers.Qwen3MoeForCausalLM(config)
    elif architecture == "mixtral":
        config = transformers.MixtralConfig(**common, sliding_window=sliding_window,
                                            **{"num_local_experts": 4, "num_experts_per_tok": 2, **(moe or {})})
        model = transformers.MixtralForCausalLM(config)
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
    MistralForCausalLM (with `sliding_window`, if given); any other `architecture` of
    `build_random_llama` builds that one (`qwen3_moe`, `mixtral`: 4 experts, top-2). bos/eos ids 1 and 2 agree between
    config.json, generation_config.json and the tokenizer.
    """
    build_random_llama(path, architecture=architecture or ("qwen2" if qkv_bias else "llama"), num_layers=num_layers,
                       hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, vocab_size=vocab,
                       tie_word_embeddings=tie, seed=seed, sliding_window=sliding_window)
    return build_tiny_tokenizer(path, vocab_size=vocab, add_bos_token=add_bos_token)



def random_checkpoint(hf_config: dict[str, Any], *, device: torch.device | str, dtype: torch.dtype,
                      seed: int = 0) -> Checkpoint:
    """A Llama model of `hf_config` (config.json's fields) with random weights, made on `device` in
    `dtype` as the engine loads them: the same seed gives the same weights, so two engines (two
    attention backends) run the same model. The tokenizer is the tiny one: ids past its 320 decode to
    nothing, so prompts are token ids."""
    directory = Path(tempfile.mkdtemp(prefix="pdserve-random-tokenizer-"))
    try:
        vocab_size = min(320, hf_config["vocab_size"])
        tokenizer = Tokenizer.from_dir(build_tiny_tokenizer(directory, vocab_size=vocab_size))
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        generator = torch.Generator(device=device).manual_seed(seed)
        for name, shape in llama_tensor_shapes(hf_config):
            yield name, random_tensor(name, shape, generator, device, dtype)

    return Checkpoint(hf_config, tokenizer, weights)


def llama_tensor_shapes(hf_config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor a Llama checkpoint of `hf_config` holds (read here
    rather than through the model registry, which the weights package must not import)."""
    hidden, heads, vocab = hf_config["hidden_size"], hf_config["num_attention_heads"], hf_config["vocab_size"]
    head_dim = hf_config.get("head_dim") or hidden // heads
    q_size, kv_size = heads * head_dim, (hf_config.get("num_key_value_heads") or heads) * head_dim
    intermediate, bias = hf_config["intermediate_size"], bool(hf_config.get("attention_bias"))
    yield "model.embed_tokens.weight", (vocab, hidden)
    for layer in range(hf_config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"{prefix}{norm}.weight", (hidden,)
        for projection, rows in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            yield f"{prefix}self_attn.{projection}.weight", (rows, hidden)
            if bias:
                yield f"{prefix}self_attn.{projection}.bias", (rows,)
        yield f"{prefix}self_attn.o_proj.weight", (hidden, q_size)
        if bias:
            yield f"{prefix}self_attn.o_proj.bias", (hidden,)
        yield f"{prefix}mlp.gate_proj.weight", (intermediate, hidden)
        yield f"{prefix}mlp.up_proj.weight", (intermediate, hidden)
        yield f"{prefix}mlp.down_proj.weight", (hidden, intermediate)
    yield "model.norm.weight", (hidden,)
    if not hf_config.get("tie_word_embeddings", False):
        yield "lm_head.weight", (vocab, hidden)


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str,
                  dtype: torch.dtype) -> torch.Tensor:
    """Matrices scaled by 1/sqrt(fan in), so that activations and logits keep a trained model's scale
    through every layer of a deep model; norms near 1; biases small."""
    values = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    if len(shape) == 2:
        return values.mul_(1 / shape[1] ** 0.5 if "embed_tokens" not in name else 1.0)
    return values.mul_(0.1).add_(1.0 if "norm" in name else 0.0)
