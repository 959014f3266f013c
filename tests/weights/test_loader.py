"""Weight loading: checkpoint directories, and GGUF files read back into Hugging Face names and layout."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cluster.common.errors import ModelLoadError
from cluster.weights.loader import (
    hf_name_for_gguf_tensor,
    iterate_safetensors,
    load_hf_config,
    permute_for_gguf,
    read_gguf,
    rope_theta,
    unpermute_from_gguf,
)
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import write_tiny_gguf

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def tied_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(
        tmp_path_factory.mktemp("qwen2"), qkv_bias=True, tie=True, heads=4, kv_heads=1
    )


# ---- Hugging Face directories -----------------------------------------------------------------


def test_load_hf_config_reads_config_json(llama_dir: Path) -> None:
    config = load_hf_config(llama_dir)
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] == 2


def test_load_hf_config_without_config_json_says_what_is_expected(tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError, match="no config.json in .*Hugging Face checkpoint directory or a .gguf"
    ):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_load_hf_config_rejects_malformed_json(tmp_path: Path, content: str) -> None:
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf_config(tmp_path)


def test_rope_theta_reads_both_spellings() -> None:
    assert rope_theta({"rope_theta": 500000.0}) == 500000.0
    assert rope_theta({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == 1e6
    assert rope_theta({}) == 10000.0


def test_iterate_safetensors_yields_every_tensor_under_hf_names(llama_dir: Path) -> None:
    expected = load_file(str(llama_dir / "model.safetensors"))
    loaded = dict(iterate_safetensors(llama_dir))
    assert loaded.keys() == expected.keys()
    assert "model.layers.1.self_attn.k_proj.weight" in loaded
    assert "lm_head.weight" in loaded
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_iterate_safetensors_leaves_out_tied_lm_head(tied_qwen2_dir: Path) -> None:
    names = {name for name, _ in iterate_safetensors(tied_qwen2_dir)}
    assert "lm_head.weight" not in names
    assert "model.layers.0.self_attn.q_proj.bias" in names


def test_iterate_safetensors_without_files_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files in"):
        list(iterate_safetensors(tmp_path))


# ---- the q/k permutation of llama.cpp ---------------------------------------------------------


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim but for names."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize(("num_heads", "head_dim", "columns"), [(4, 16, 64), (3, 8, 24), (2, 4, None)])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int, head_dim: int, columns: int | None) -> None:
    shape = (num_heads * head_dim,) if columns is None else (num_heads * head_dim, columns)
    weights = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    permuted = llama_cpp_permute(weights, num_heads, num_heads)
    assert np.array_equal(permute_for_gguf(weights, num_heads), permuted)
    assert not np.array_equal(permuted, weights)
    assert np.array_equal(unpermute_from_gguf(permuted, num_heads), weights)


def test_permute_interleaves_rotary_halves_per_head() -> None:
    # One head of dimension 4: rows [x0, x1, y0, y1] (HF's half-split) become [x0, y0, x1, y1].
    rows = np.arange(4, dtype=np.float32)[:, None]
    assert permute_for_gguf(rows, 1)[:, 0].tolist() == [0, 2, 1, 3]


# ---- GGUF files -------------------------------------------------------------------------------


def test_hf_name_for_gguf_tensor() -> None:
    assert hf_name_for_gguf_tensor("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name_for_gguf_tensor("output.weight") == "lm_head.weight"
    assert (
        hf_name_for_gguf_tensor("blk.12.ffn_norm.weight") == "model.layers.12.post_attention_layernorm.weight"
    )
    assert hf_name_for_gguf_tensor("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    with pytest.raises(ModelLoadError, match="unexpected GGUF tensor"):
        hf_name_for_gguf_tensor("blk.0.ffn_gate_exps.weight")


@pytest.mark.parametrize("float_type", ["F32", "F16"])
def test_read_gguf_recovers_llama_tensors_and_config(
    llama_dir: Path, tmp_path: Path, float_type: str
) -> None:
    path = write_tiny_gguf(llama_dir, tmp_path / "tiny.gguf", float_type=float_type)
    checkpoint = read_gguf(path)
    original = load_file(str(llama_dir / "model.safetensors"))
    assert checkpoint.tensors.keys() == original.keys()
    for name, tensor in original.items():
        restored = checkpoint.tensors[name]
        assert restored.dtype == torch.float32 and restored.is_contiguous()
        expected = tensor.half().float() if float_type == "F16" and tensor.dim() == 2 else tensor
        assert torch.equal(restored, expected), name
    hf_config = load_hf_config(llama_dir)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "vocab_size",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert checkpoint.hf_config[key] == hf_config[key], key
    assert checkpoint.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert checkpoint.hf_config["rope_theta"] == rope_theta(hf_config)


def test_read_gguf_dequantizes_quantized_tensors(llama_dir: Path, tmp_path: Path) -> None:
    quantize = {"token_embd.weight": "Q8_0", "blk.0.attn_q.weight": "Q4_1", "blk.1.attn_k.weight": "Q8_0"}
    checkpoint = read_gguf(write_tiny_gguf(llama_dir, tmp_path / "tiny.gguf", quantize=quantize))
    original = load_file(str(llama_dir / "model.safetensors"))
    for gguf_name, qtype in quantize.items():
        name = hf_name_for_gguf_tensor(gguf_name)
        kind = gguf.GGMLQuantizationType[qtype]
        # Blocks run along rows, which the q/k permutation moves whole: quantizing before or after
        # permuting gives the same values, so the expectation needs no permutation.
        expected = gguf.quants.dequantize(gguf.quants.quantize(original[name].numpy(), kind), kind)
        assert np.array_equal(checkpoint.tensors[name].numpy(), expected), name
        assert not torch.equal(checkpoint.tensors[name], original[name])  # it really was quantized


def test_read_gguf_qwen2_keeps_biases_and_tied_embeddings(tied_qwen2_dir: Path, tmp_path: Path) -> None:
    checkpoint = read_gguf(write_tiny_gguf(tied_qwen2_dir, tmp_path / "tiny.gguf"))
    original = load_file(str(tied_qwen2_dir / "model.safetensors"))
    assert checkpoint.tensors.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(checkpoint.tensors[name], tensor), name
    assert checkpoint.hf_config["architectures"] == ["Qwen2ForCausalLM"]
    assert checkpoint.hf_config["tie_word_embeddings"] is True


def test_read_gguf_matches_transformers_gguf_loading(llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(llama_dir, tmp_path / "tiny.gguf", quantize={"blk.0.attn_q.weight": "Q8_0"})
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    reference_tensors = reference.state_dict()
    for name, tensor in read_gguf(path).tensors.items():
        assert torch.equal(tensor, reference_tensors[name].float()), name


def test_read_gguf_tokenizer_metadata(llama_dir: Path, tmp_path: Path) -> None:
    tokenizer = read_gguf(write_tiny_gguf(llama_dir, tmp_path / "tiny.gguf")).tokenizer
    assert tokenizer.model == "gpt2"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.add_bos_token is False


def test_read_gguf_rejects_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match="unsupported GGUF architecture 'mamba'.*supported: llama, qwen2"
    ):
        read_gguf(path)


def test_read_gguf_rejects_missing_and_non_gguf_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        read_gguf(tmp_path / "absent.gguf")
    (tmp_path / "fake.gguf").write_bytes(b"definitely not a gguf file")
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_gguf(tmp_path / "fake.gguf")
