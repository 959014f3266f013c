"""A GGUF model served with its weights kept quantized: the packed reader keeps exactly the weights a
model can compute packed, and the model's logits equal those of the same file widened at load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.model.quantized import QuantizedEmbedding, QuantizedLinear, dequantize, quantize_modules
from cluster.weights.gguf_packed import read_packed
from cluster.weights.loader import read_gguf
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import write_tiny_gguf


def quantized_names(layers: int, mixed: bool) -> dict[str, str]:
    names = {"token_embd.weight": "Q8_0"}
    for layer in range(layers):
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            names[f"blk.{layer}.{part}.weight"] = "Q4_1"
        names[f"blk.{layer}.attn_v.weight"] = "Q8_0" if mixed and layer == 0 else "Q4_1"
    return names


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("packed")
    checkpoint = build_tiny_llama_checkpoint(directory / "hf", hidden=64, heads=4, kv_heads=2, tie=True)
    return write_tiny_gguf(checkpoint, directory / "model.gguf", quantize=quantized_names(2, mixed=True))


def test_the_reader_keeps_what_the_model_computes_packed(gguf_file: Path) -> None:
    packed = read_packed(gguf_file)
    assert packed.qtypes["model.embed_tokens.weight"] == "Q8_0"
    assert packed.qtypes["model.layers.1.self_attn.qkv_proj.weight"] == "Q4_1"
    assert "model.layers.0.self_attn.qkv_proj.weight" not in packed.qtypes  # q/k Q4_1, v Q8_0: widened
    assert "model.layers.0.self_attn.v_proj.weight" not in packed.kept
    assert packed.qtypes["model.layers.0.mlp.gate_up_proj.weight"] == "Q4_1"
    tensors = dict(packed.tensors())
    assert tensors["model.layers.1.self_attn.q_proj.weight"].dtype == torch.uint8
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    assert tensors["model.norm.weight"].dtype == torch.float32


def test_packed_rows_widen_to_the_widened_checkpoint(gguf_file: Path) -> None:
    """Row order included: Llama q/k rows are unpermuted on the packed rows as on the widened ones."""
    packed = read_packed(gguf_file)
    widened = read_gguf(gguf_file).tensors
    for name, tensor in packed.tensors():
        got = dequantize(tensor, packed.kept[name]) if name in packed.kept else tensor
        assert torch.equal(got, widened[name]), name


def test_quantize_modules_then_load_gives_the_widened_models_logits(gguf_file: Path) -> None:
    from cluster.model.models.llama import LlamaForCausalLM
    from cluster.model.registry import architecture_config

    checkpoint = read_gguf(gguf_file)
    arch = architecture_config(checkpoint.hf_config)
    from cluster.model.attention.registry import get_attention_backend

    backend = get_attention_backend("torch", torch.device("cpu"))
    widened = LlamaForCausalLM(arch, backend, max_positions=64)
    widened.load_weights(checkpoint.tensors.items())
    packed = read_packed(gguf_file)
    kept = LlamaForCausalLM(arch, backend, max_positions=64)
    quantize_modules(kept, packed.qtypes, torch.float32)
    kept.load_weights(packed.tensors())
    assert isinstance(kept.model.embed_tokens, QuantizedEmbedding) and isinstance(kept.lm_head, QuantizedLinear)
    hidden = torch.randn(3, arch.hidden_size)
    for rows in (hidden[:1], hidden):
        torch.testing.assert_close(kept.compute_logits(rows), widened.compute_logits(rows), atol=1e-4, rtol=1e-4)
        layer_k, layer_w = kept.model.layers[1].mlp, widened.model.layers[1].mlp
        torch.testing.assert_close(layer_k(rows), layer_w(rows), atol=1e-4, rtol=1e-4)


def test_an_engine_keeping_the_file_packed_generates_the_widened_engines_tokens(gguf_file: Path) -> None:
    """`quantization: gguf` through LLMEngine: the same greedy tokens as the file widened at load, in
    far less memory (the packed layers hold 5 bits per 4-bit weight, 8.5 per 8-bit one)."""
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
    from cluster.engine.llm_engine import LLMEngine

    def engine(quantization: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=str(gguf_file), dtype="float32",
                                                        quantization=quantization),
                                      cache=CacheConfig(block_size=4, num_blocks=64)))

    packed, widened = engine("gguf"), engine("none")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 33, 9, 81, 120], [200, 3, 77]]
    assert [o.token_ids for o in packed.generate(prompts, params)] == \
        [o.token_ids for o in widened.generate(prompts, params)]
    layers = packed.runner.model.model.layers
    assert isinstance(layers[1].self_attn.qkv_proj, QuantizedLinear) and \
        isinstance(layers[0].self_attn.qkv_proj, torch.nn.Linear)  # layer 0's mixed q/k/v: widened

    def nbytes(model: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    bf16_bytes = nbytes(widened.runner.model.model.layers[1]) // 2  # the fp32 engine's layer, at 2 bytes a weight
    assert nbytes(layers[1]) * 3 < bf16_bytes


def test_quantization_gguf_needs_a_gguf_file(tmp_path: Path) -> None:
    from cluster.engine.config import EngineConfig, ModelConfig
    from cluster.engine.llm_engine import LLMEngine

    checkpoint = build_tiny_llama_checkpoint(tmp_path / "hf")
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLMEngine(EngineConfig(model=ModelConfig(model=str(checkpoint), quantization="gguf")))
    with pytest.raises(ValueError, match="quantization must be one of"):
        ModelConfig(quantization="awq")


def test_five_bit_weights_stay_packed_and_give_the_widened_engines_tokens(tmp_path: Path) -> None:
    """Q5_0 embeddings (tied to the head) and Q5_1 layers, as a file quantized with a 5-bit token table."""
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
    from cluster.engine.llm_engine import LLMEngine

    checkpoint = build_tiny_llama_checkpoint(tmp_path / "hf", hidden=64, heads=4, kv_heads=2, tie=True)
    names = {name: "Q5_1" for name in quantized_names(2, mixed=False)} | {"token_embd.weight": "Q5_0"}
    path = write_tiny_gguf(checkpoint, tmp_path / "model.gguf", quantize=names)
    assert read_packed(path).qtypes["model.layers.0.mlp.gate_up_proj.weight"] == "Q5_1"

    def engine(quantization: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32", quantization=quantization),
                                      cache=CacheConfig(block_size=4, num_blocks=64)))

    packed, widened = engine("gguf"), engine("none")
    assert isinstance(packed.runner.model.model.embed_tokens, QuantizedEmbedding)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 33, 9, 81, 120], [200, 3, 77]]
    assert [o.token_ids for o in packed.generate(prompts, params)] == \
        [o.token_ids for o in widened.generate(prompts, params)]


def test_k_quant_weights_stay_packed_and_give_the_widened_engines_tokens(tmp_path: Path) -> None:
    """Q6_K embeddings (tied to the head), Q5_K and Q6_K layers, as a Q4_K_M file mixes them; layer 0's v is
    Q6_K beside Q5_K q/k, as that file's, so its q/k/v are widened. K-quants need rows of 256 weights."""
    from cluster.common.sampling_params import SamplingParams
    from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
    from cluster.engine.llm_engine import LLMEngine

    checkpoint = build_tiny_llama_checkpoint(tmp_path / "hf", hidden=256, heads=4, kv_heads=2, tie=True)
    names = {name: "Q6_K" if "attn_output" in name or "ffn_down" in name else "Q5_K"
             for name in quantized_names(2, mixed=False)}
    names |= {"token_embd.weight": "Q6_K", "blk.0.attn_v.weight": "Q6_K"}
    path = write_tiny_gguf(checkpoint, tmp_path / "model.gguf", quantize=names)
    packed_file = read_packed(path)
    assert packed_file.qtypes["model.layers.1.self_attn.qkv_proj.weight"] == "Q5_K"
    assert packed_file.qtypes["model.layers.0.mlp.down_proj.weight"] == "Q6_K"
    assert "model.layers.0.self_attn.qkv_proj.weight" not in packed_file.qtypes

    def engine(quantization: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32", quantization=quantization),
                                      cache=CacheConfig(block_size=4, num_blocks=64)))

    packed, widened = engine("gguf"), engine("none")
    model = packed.runner.model
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and model.model.embed_tokens.qtype == "Q6_K"
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    layer = model.model.layers[1]
    assert (layer.self_attn.qkv_proj.qtype, layer.self_attn.o_proj.qtype) == ("Q5_K", "Q6_K")
    assert (layer.mlp.gate_up_proj.qtype, layer.mlp.down_proj.qtype) == ("Q5_K", "Q6_K")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 33, 9, 81, 120], [200, 3, 77]]
    assert [o.token_ids for o in packed.generate(prompts, params)] == \
        [o.token_ids for o in widened.generate(prompts, params)]
    hidden = torch.randn(20, 256)
    for rows in (hidden[:1], hidden):  # the C kernel's rows, then a widened weight's matmul
        torch.testing.assert_close(model.compute_logits(rows), widened.runner.model.compute_logits(rows),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.mlp(rows), widened.runner.model.model.layers[1].mlp(rows),
                                   atol=1e-4, rtol=1e-4)
