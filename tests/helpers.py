"""Builders shared by the tests: tiny random-weight checkpoints, engines and requests."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
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


# ---- tokenizers, checkpoints with a tokenizer, and GGUF files (loader and tokenizer tests) ----------

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
    import json

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
                                tie: bool = False, seed: int = 0, add_bos_token: bool = False) -> Path:
    """A complete random-weight checkpoint directory: `build_random_llama` weights plus a tiny tokenizer.

    `qkv_bias=True` makes it a Qwen2ForCausalLM (biases on q/k/v only). bos/eos ids 1 and 2 agree
    between config.json, generation_config.json and the tokenizer.
    """
    build_random_llama(path, architecture="qwen2" if qkv_bias else "llama", num_layers=num_layers,
                       hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, vocab_size=vocab,
                       tie_word_embeddings=tie, seed=seed)
    return build_tiny_tokenizer(path, vocab_size=vocab, add_bos_token=add_bos_token)


def write_tiny_gguf(checkpoint_dir: Path, gguf_path: Path, *, float_type: str = "F32",
                    quantize: dict[str, str] | None = None) -> Path:
    """Write a tiny Hugging Face checkpoint (with tokenizer) as a GGUF file, the way llama.cpp would.

    Llama q/k rows are permuted for llama.cpp's RoPE layout (Qwen2's are not); 2-D weights are stored
    as `float_type` ("F32" or "F16"), norms and biases as F32; `quantize` maps GGUF tensor names to a
    quantization ("Q8_0", "Q4_1", ...) for those tensors. The tokenizer goes into tokenizer.ggml.*
    metadata, padded with unused "[PAD<i>]" tokens up to the model's vocabulary, as llama.cpp pads.
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from cluster.loader import load_hf_config, permute_for_gguf

    config = load_hf_config(checkpoint_dir)
    architecture = config["model_type"]
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(gguf_path), architecture)
    _write_gguf_model_metadata(writer, config)
    _write_gguf_tokenizer_metadata(writer, checkpoint_dir, config["vocab_size"])
    hf_to_gguf = _hf_to_gguf_names(config["num_hidden_layers"])
    quantize = quantize or {}
    for hf_name, values in load_file(str(checkpoint_dir / "model.safetensors")).items():
        name = hf_to_gguf[hf_name]
        if architecture == "llama" and ".attn_q." in name:
            values = permute_for_gguf(values, config["num_attention_heads"])
        elif architecture == "llama" and ".attn_k." in name:
            values = permute_for_gguf(values, config["num_key_value_heads"])
        if name in quantize:
            qtype = gguf.GGMLQuantizationType[quantize[name]]
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            dtype = np.float16 if float_type == "F16" and values.ndim == 2 else np.float32
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def _write_gguf_model_metadata(writer: Any, config: dict) -> None:
    from cluster.loader import rope_theta

    prefix = config["model_type"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    writer.add_string("general.name", "tiny-test-model")
    for key, value in (("block_count", config["num_hidden_layers"]),
                       ("context_length", config["max_position_embeddings"]),
                       ("embedding_length", config["hidden_size"]),
                       ("feed_forward_length", config["intermediate_size"]),
                       ("attention.head_count", config["num_attention_heads"]),
                       ("attention.head_count_kv", config["num_key_value_heads"]),
                       ("rope.dimension_count", head_dim),
                       ("vocab_size", config["vocab_size"])):
        writer.add_uint32(f"{prefix}.{key}", value)
    writer.add_float32(f"{prefix}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32(f"{prefix}.rope.freq_base", rope_theta(config))


def _write_gguf_tokenizer_metadata(writer: Any, checkpoint_dir: Path, vocab_size: int) -> None:
    import json

    tokenizer_json = json.loads((checkpoint_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer_config = json.loads((checkpoint_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    by_id = {index: token for token, index in tokenizer_json["model"]["vocab"].items()}
    special = {added["id"] for added in tokenizer_json["added_tokens"] if added["special"]}
    tokens = [by_id.get(index, f"[PAD{index}]") for index in range(vocab_size)]
    # llama.cpp token types: 1 normal, 3 control (special), 5 unused (padding).
    types = [3 if index in special else 1 if index in by_id else 5 for index in range(vocab_size)]
    # tokenizers writes merges as ["a", "b"] pairs (older versions: "a b"); GGUF stores "a b".
    merges = [pair if isinstance(pair, str) else " ".join(pair) for pair in tokenizer_json["model"]["merges"]]
    processor = tokenizer_json.get("post_processor") or {}
    adds_bos = any("SpecialToken" in piece for piece in processor.get("single", []))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(tokenizer_config["bos_token"]))
    writer.add_eos_token_id(tokens.index(tokenizer_config["eos_token"]))
    writer.add_pad_token_id(tokens.index(tokenizer_config["pad_token"]))
    writer.add_add_bos_token(adds_bos)
    if "chat_template" in tokenizer_config:
        writer.add_chat_template(tokenizer_config["chat_template"])


def _hf_to_gguf_names(num_layers: int) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}
    for layer in range(num_layers):
        for hf_part, gguf_part in per_layer.items():
            for suffix in ("weight", "bias"):
                names[f"model.layers.{layer}.{hf_part}.{suffix}"] = f"blk.{layer}.{gguf_part}.{suffix}"
    return names


def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) converted for transformers and our loaders.

    Converted on first use into the user's cache ($PDSERVE_CACHE_DIR or ~/.cache/pdserve) and reused
    by later runs, so only the first test run pays the ~30 s conversion.
    """
    from cluster.default_model import resolve_model_path

    return resolve_model_path("default", progress=False)


@contextlib.contextmanager
def nothing_logged_and_idle(caplog: pytest.LogCaptureFixture, idle: Callable[[], bool],
                            timeout_s: float = 20.0) -> Iterator[None]:
    """Around a fuzz test, in a fixture: afterwards no ERROR was logged by `cluster.*`, and `idle()`
    (nothing running, every KV block free) holds within `timeout_s`."""
    with caplog.at_level(logging.ERROR, logger="cluster"):
        yield
    logged = caplog.get_records("call")  # a fixture's exit runs in teardown: ask for the test's own records
    assert not [record.getMessage() for record in logged if record.name.startswith("cluster")]
    end = time.monotonic() + timeout_s
    while not idle():
        assert time.monotonic() < end, "requests left running or KV blocks taken"
        time.sleep(0.02)
