"""Builders shared by the tests: GGUF files of tiny checkpoints (`cluster.weights.synthetic` builds the
checkpoints), the default model's directory, and log checks."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cluster.engine.config import EngineConfig, ModelConfig


def fp32_model(model: str | Path = "default", **fields: Any) -> ModelConfig:
    """A model config in fp32. Tests compare tokens with transformers' fp32 and with each other, on any
    CPU; dtype auto (the default) would take bf16 on CPUs with native bf16 matmuls and fp32 elsewhere."""
    return ModelConfig(model=str(model), dtype="float32", **fields)


def on_cpu(config: Any) -> Any:
    """A `ClusterConfig` whose engines run on the CPU where its device is auto: on a GPU host the
    tests' clusters of 3-4 workers would otherwise ask Ray for a GPU each (tests/conftest.py)."""
    from dataclasses import replace

    model = config.engine.model
    if model.device != "auto":
        return config
    return replace(config, engine=replace(config.engine, model=replace(model, device="cpu")))


def fp32_engine(model: str | Path, **fields: Any) -> EngineConfig:
    """An engine config in fp32 from the cluster config's flat engine keys (block_size, num_blocks, ...)."""
    from cluster.ray_cluster.config import engine_config_from

    return engine_config_from({"dtype": "float32", "model": str(model), **fields})


# ---- GGUF files (loader and tokenizer tests) ------------------------------------------------------

def write_tiny_gguf(checkpoint_dir: Path, gguf_path: Path, *, float_type: str = "F32",
                    quantize: dict[str, str] | None = None) -> Path:
    """Write a tiny Hugging Face checkpoint (with tokenizer) as a GGUF file, the way llama.cpp would.

    Llama q/k rows are permuted for llama.cpp's RoPE layout (Qwen2's are not); 2-D weights are stored
    as `float_type` ("F32" or "F16"), norms and biases as F32; `quantize` maps GGUF tensor names to a
    quantization ("Q8_0", "Q4_1", "Q6_K", ...) for those tensors. The tokenizer goes into tokenizer.ggml.*
    metadata, padded with unused "[PAD<i>]" tokens up to the model's vocabulary, as llama.cpp pads.
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from cluster.weights.loader import load_hf_config, permute_for_gguf

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
            quantizer = K_QUANTIZERS.get(quantize[name])
            data = quantizer(values.astype(np.float32)) if quantizer else gguf.quants.quantize(values, qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
        else:
            dtype = np.float16 if float_type == "F16" and values.ndim == 2 else np.float32
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def quantize_q6_k(values: Any) -> Any:
    """[rows, columns] float32 as Q6_K super-blocks [rows, columns / 256 * 210] (uint8), which gguf's Python
    cannot make: ql (low 4 bits), qh (high 2 bits), 16 int8 scales, fp16 d, as llama.cpp lays them out;
    each 16 weights' scale is their largest magnitude over 31, d the block's largest scale over 127."""
    import numpy as np

    blocks = values.reshape(-1, 16, 16)
    scale = np.abs(blocks).max(axis=-1) / 31
    d = (scale.max(axis=-1, keepdims=True) / 127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.nan_to_num(np.round(scale / d.astype(np.float32))).astype(np.int8)
        step = (d.astype(np.float32) * scales)[..., None]
        q = np.clip(np.nan_to_num(np.round(blocks / step)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # two halves of four 32-weight runs
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    packed = np.concatenate([ql, qh, scales.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=-1)
    return packed.reshape(values.shape[0], -1)


def quantize_q5_k(values: Any) -> Any:
    """[rows, columns] float32 as Q5_K super-blocks [rows, columns / 256 * 176] (uint8), which gguf's Python
    cannot make: fp16 d and dmin, eight 6-bit scales and mins in 12 bytes (as Q4_K's), 32 bytes of 5th bits,
    128 bytes of 4-bit q; each 32 weights are w = d * scale * q - dmin * min with q in 0..31."""
    import numpy as np

    blocks = values.reshape(-1, 8, 32)
    low = np.maximum(-blocks.min(axis=-1), 0)
    scale = (blocks.max(axis=-1) + low) / 31
    d = (scale.max(axis=-1, keepdims=True) / 63).astype(np.float16)
    dmin = (low.max(axis=-1, keepdims=True) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d.astype(np.float32))), 0, 63).astype(np.uint8)
        mn = np.clip(np.nan_to_num(np.round(low / dmin.astype(np.float32))), 0, 63).astype(np.uint8)
        offset = (dmin.astype(np.float32) * mn)[..., None]
        q = np.nan_to_num(np.round((blocks + offset) / (d.astype(np.float32) * sc)[..., None]))
    q = np.clip(q, 0, 31).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)], axis=-1)
    qh = np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=1)  # bit j: sub-block j
    qs = ((q[:, 0::2] & 0x0F) | ((q[:, 1::2] & 0x0F) << 4)).reshape(-1, 128)
    packed = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qh, qs],
                            axis=-1)
    return packed.reshape(values.shape[0], -1)


K_QUANTIZERS: dict[str, Callable[[Any], Any]] = {"Q6_K": quantize_q6_k, "Q5_K": quantize_q5_k}


def _write_gguf_model_metadata(writer: Any, config: dict) -> None:
    from cluster.weights.loader import rope_theta

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
    from cluster.weights.default_model import resolve_model_path

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


def until_idle(engine: Any, limit: int = 2_000) -> Iterator[int]:
    """Step numbers while `engine` has unfinished requests, at most `limit`: a hang fails the test at
    once instead of running into its timeout (mutation testing plants many)."""
    for step in range(limit):
        if not engine.has_unfinished_requests():
            return
        yield step
    raise AssertionError(f"the engine still had unfinished requests after {limit} steps")
