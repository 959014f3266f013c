"""8-bit safetensors checkpoints (compressed-tensors int8 and fp8, DeepSeek/Qwen-style block fp8) served
with their weights kept 8-bit: the layers hold int8 / float8_e4m3fn values and their scales in about half
the bytes of bf16, and compute what an fp32 model of the dequantized weights computes.

The oracle dequantizes the files here, block by block of each format's scale grid, apart from the
reader's per-row scales, so that a reader misplacing a scale (transposed, a block off by one) differs."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.common.errors import ModelLoadError
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.model.scaled import ScaledLinear
from cluster.weights.quantize import quantize_checkpoint
from cluster.weights.scaled_safetensors import read_scheme
from cluster.weights.synthetic import build_tiny_llama_checkpoint

# scheme -> (quantize_checkpoint's scheme, its block, the weights' storage dtype)
SCHEMES: dict[str, tuple[str, tuple[int, int] | None, torch.dtype]] = {
    "int8-channel": ("int8-channel", None, torch.int8),
    "int8-packed": ("int8-packed", None, torch.int8),
    "int8-group": ("int8-group", (1, 128), torch.int8),
    "fp8-tensor": ("fp8-tensor", None, torch.float8_e4m3fn),
    "fp8-block": ("fp8-block", (128, 128), torch.float8_e4m3fn),
    "fp8-block-ragged": ("fp8-block", (48, 80), torch.float8_e4m3fn),  # blocks cut short at every edge
}
PROMPTS = [[5, 17, 33, 9, 81, 120], [200, 3, 77]]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("float") / "hf", hidden=256, heads=4, kv_heads=2)


@pytest.fixture(scope="module", params=list(SCHEMES))
def scheme(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def quantized(scheme: str, source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name, block, _ = SCHEMES[scheme]
    return quantize_checkpoint(source, tmp_path_factory.mktemp(scheme), name, block=block or (128, 128))


def block_shape(config: dict[str, Any], values: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """Rows and columns one scale covers, from the format's definition."""
    rows, columns = values.shape
    if scale.numel() == 1:
        return rows, columns
    if config.get("weight_block_size"):
        return tuple(config["weight_block_size"])  # type: ignore[return-value]
    group_size = config.get("config_groups", {}).get("group_0", {}).get("weights", {}).get("group_size")
    return 1, group_size or columns  # per group of columns in a row, or per channel: per row


def unpack_int32(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized int8: four values offset by 128 per int32, lowest byte first."""
    parts = [((packed >> (8 * byte)) & 0xFF) - 128 for byte in range(4)]
    return torch.stack(parts, dim=-1).reshape(packed.shape[0], -1)[:, :columns]


def dequantized(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a quantized checkpoint as fp32, each weight times its scales block by block."""
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(str(path))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, kind = name.rpartition(".")
        scale = tensors.get(f"{prefix}.weight_scale", tensors.get(f"{prefix}.weight_scale_inv"))
        if kind == "weight_packed":
            values = unpack_int32(tensors[name], int(tensors[f"{prefix}.weight_shape"][1])).float()
        elif kind == "weight" and scale is not None:
            values = tensor.float()
        else:
            if scale is None:
                out[name] = tensor.float()
            continue
        scale = scale.float().reshape(-1, 1) if scale.numel() > 1 and scale.dim() == 1 else scale.float()
        block_rows, block_columns = block_shape(config, values, scale)
        grid = scale.reshape(-1, 1) if scale.numel() == 1 else scale
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                values[i * block_rows:(i + 1) * block_rows, j * block_columns:(j + 1) * block_columns] *= grid[i, j]
        out[f"{prefix}.weight"] = values
    return out


def write_dequantized(directory: Path, destination: Path) -> Path:
    """The oracle: `directory` as an fp32 float checkpoint (config without its quantization_config)."""
    shutil.copytree(directory, destination)
    for path in destination.glob("*.safetensors"):
        path.unlink()
    save_file(dequantized(directory), str(destination / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def engine(model: Path, quantization: str = "none") -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(model), dtype="float32", quantization=quantization),
                                  cache=CacheConfig(block_size=4, num_blocks=64)))


def nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_the_quantizer_stays_near_the_float_weights(source: Path, scheme: str, quantized: Path) -> None:
    original = load_file(str(source / "model.safetensors"))
    fp8 = scheme.startswith("fp8")
    for name, values in dequantized(quantized).items():
        error = (values - original[name].float()).norm() / original[name].float().norm()
        assert error < (0.05 if fp8 else 0.01), name


def test_the_weights_stay_8_bit_in_about_half_the_bytes_of_bf16(source: Path, scheme: str, quantized: Path) -> None:
    storage = SCHEMES[scheme][2]
    kept, widened = engine(quantized), engine(source)
    for kept_layer, widened_layer in zip(kept.runner.model.model.layers, widened.runner.model.model.layers,
                                         strict=True):
        for projection in (kept_layer.self_attn.qkv_proj, kept_layer.self_attn.o_proj,
                           kept_layer.mlp.gate_up_proj, kept_layer.mlp.down_proj):
            assert isinstance(projection, ScaledLinear) and projection.weight.dtype == storage
            assert projection.weight_scale.dtype == torch.float32
        bf16_bytes = nbytes(widened_layer) // 2  # the fp32 engine's layer at 2 bytes a weight
        assert nbytes(kept_layer) < 0.55 * bf16_bytes


def test_logits_and_tokens_equal_the_dequantized_fp32_models(quantized: Path, tmp_path: Path) -> None:
    kept, oracle = engine(quantized), engine(write_dequantized(quantized, tmp_path / "oracle"))
    hidden = torch.randn(5, kept.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    for kept_layer, oracle_layer in zip(kept.runner.model.model.layers, oracle.runner.model.model.layers,
                                        strict=True):
        for rows in (hidden[:1], hidden):
            torch.testing.assert_close(kept_layer.self_attn.qkv_proj(rows), oracle_layer.self_attn.qkv_proj(rows),
                                       atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(kept_layer.mlp(rows), oracle_layer.mlp(rows), atol=1e-4, rtol=1e-4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    kept_out, oracle_out = kept.generate(PROMPTS, params), oracle.generate(PROMPTS, params)
    assert [o.token_ids for o in kept_out] == [o.token_ids for o in oracle_out]


@pytest.mark.parametrize("qtype", ["int8", "fp8", "int8/64", "fp8/48"])
def test_bf16_activations_stay_within_bf16_rounding_of_the_fp32_product(qtype: str) -> None:
    from cluster.model.scaled import STORAGE

    generator = torch.Generator().manual_seed(0)
    layer = ScaledLinear(160, 96, qtype, bias=True, dtype=torch.bfloat16)
    storage = STORAGE[qtype.partition("/")[0]]
    layer.weight.copy_((torch.randn(96, 160, generator=generator) * 40).clamp(-127, 127).to(storage))
    layer.weight_scale.copy_(torch.rand(layer.weight_scale.shape, generator=generator) / 100)
    layer.bias.copy_(torch.randn(96, generator=generator))  # type: ignore[union-attr]
    x = torch.randn(3, 160, generator=generator)
    widened = layer.weight.float() * layer.weight_scale.repeat_interleave(layer.group, dim=1)[:, :160]
    expected = torch.nn.functional.linear(x, widened, layer.bias.float())  # type: ignore[union-attr]
    torch.testing.assert_close(layer(x.bfloat16()).float(), expected, atol=0.05, rtol=0.02)


def test_the_quantization_flag_names_what_config_json_declares(source: Path, tmp_path: Path) -> None:
    int8 = quantize_checkpoint(source, tmp_path / "int8", "int8-channel")
    assert isinstance(engine(int8, "compressed-tensors").runner.model.model.layers[0].mlp.down_proj, ScaledLinear)
    with pytest.raises(ValueError, match="declares 'compressed-tensors'"):
        engine(int8, "fp8")
    with pytest.raises(ValueError, match="no quantization_config"):
        engine(source, "fp8")


def compressed(weights: dict[str, Any], **fields: Any) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel",
                                                "symmetric": True, "dynamic": False, **weights}}
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized",
                                    "config_groups": {"group_0": group}, "ignore": ["lm_head"], **fields}}


@pytest.mark.parametrize(("config", "refusal"), [
    (compressed({"num_bits": 4}, format="pack-quantized"), "4-bit"),
    (compressed({"symmetric": False}), "asymmetric"),
    (compressed({"strategy": "token"}), "strategy 'token'"),
    (compressed({"strategy": "group", "group_size": 128, "actorder": "group"}), "actorder"),
    (compressed({}, format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
    (compressed({}, kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (compressed({"type": "float"}, format="int-quantized"), "float weights in format 'int-quantized'"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "e5m2"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method 'awq'"),
])
def test_unsupported_schemes_are_refused_by_name(config: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ModelLoadError, match=refusal):
        read_scheme(config)


def test_quantized_activations_are_computed_unquantized_and_said_so(caplog: pytest.LogCaptureFixture) -> None:
    """A W8A8 checkpoint: its weights kept int8, its activations left in the model's dtype (as vLLM's
    weight-only fallback on hardware without 8-bit matmuls), with a warning that says so."""
    config = compressed({}, format="int-quantized")
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
    with caplog.at_level(logging.WARNING):
        scheme = read_scheme(config)
    assert scheme is not None and scheme.qtype == "int8"
    assert "activations" in caplog.text and "unquantized" in caplog.text


def test_a_float_checkpoint_has_no_scheme() -> None:
    assert read_scheme({"architectures": ["LlamaForCausalLM"]}) is None
