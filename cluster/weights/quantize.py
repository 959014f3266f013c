"""Quantize a float safetensors checkpoint into the 8-bit formats `cluster.weights.scaled_safetensors`
reads, laid out as llm-compressor and DeepSeek's fp8 converter lay them out: the tests' quantized
checkpoints and the quantized benchmark's. The decoder's linear layers are quantized; embeddings,
norms and lm_head stay as stored (llm-compressor's usual `ignore: ["lm_head"]`).

- `int8-channel`: compressed-tensors int-quantized, symmetric int8, a scale per output row (W8A16);
- `int8-packed`: the same values pack-quantized, four to an int32 (`weight_packed`, `weight_shape`);
- `int8-group`: compressed-tensors int-quantized, a scale per row and group of `block[1]` columns;
- `fp8-tensor`: compressed-tensors float-quantized, float8_e4m3fn with one scale per tensor;
- `fp8-block`: quant_method fp8, e4m3 with a float32 `weight_scale_inv` per `block` of rows and columns.

compressed-tensors scales are stored in bf16, as llm-compressor stores them in a bf16 model's dtype,
and the weights are quantized by the scale so rounded: the stored scale is the one they were made for.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from cluster.weights.loader import iterate_safetensors, load_hf_config

SCHEMES = ("int8-channel", "int8-packed", "int8-group", "fp8-tensor", "fp8-block")
LINEAR = re.compile(r"\.\w+_proj\.weight$")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_checkpoint(source: Path, destination: Path, scheme: str, *, block: tuple[int, int] = (128, 128)) -> Path:
    """`source`'s checkpoint quantized by `scheme` into `destination` (tokenizer files copied); returns it."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    from safetensors.torch import save_file

    destination.mkdir(parents=True, exist_ok=True)
    for path in Path(source).iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not path.name.endswith(".safetensors.index.json"):
            shutil.copy2(path, destination / path.name)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_safetensors(source):
        if LINEAR.search(name) and ".experts." not in name:
            tensors |= _quantized(name.removesuffix(".weight"), tensor.float(), scheme, block)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(destination / "model.safetensors"))
    config = load_hf_config(source) | {"quantization_config": quantization_config(scheme, block)}
    (destination / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return destination


def _quantized(prefix: str, weight: torch.Tensor, scheme: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    if scheme == "fp8-block":
        values, scale = quantize_fp8_blocks(weight, block)
        return {f"{prefix}.weight": values, f"{prefix}.weight_scale_inv": scale}
    if scheme == "fp8-tensor":
        scale = (weight.abs().amax() / FP8_MAX).clamp(min=1e-12).to(torch.bfloat16).reshape(1)
        values = (weight / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {f"{prefix}.weight": values, f"{prefix}.weight_scale": scale}
    group = block[1] if scheme == "int8-group" else weight.shape[1]
    groups = weight.reshape(weight.shape[0], -1, group)
    scale = (groups.abs().amax(dim=2) / 127).clamp(min=1e-12).to(torch.bfloat16)
    values = (groups / scale.float()[..., None]).round().clamp(-128, 127).to(torch.int8).reshape(weight.shape)
    if scheme == "int8-packed":
        return {f"{prefix}.weight_packed": pack_int8(values), f"{prefix}.weight_scale": scale,
                f"{prefix}.weight_shape": torch.tensor(values.shape, dtype=torch.int64)}
    return {f"{prefix}.weight": values, f"{prefix}.weight_scale": scale}


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and a float32 scale per block (the last blocks cut short at the edges)."""
    rows, columns = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :columns] = weight
    blocks = padded.reshape(grid[0], block[0], grid[1], block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    values = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(padded.shape)[:rows, :columns]
    return values.to(torch.float8_e4m3fn).contiguous(), scale


def pack_int8(values: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' pack-quantized int8: each value + 128 as a byte, four to an int32, lowest first."""
    rows, columns = values.shape
    padded = torch.full((rows, math.ceil(columns / 4) * 4), 128, dtype=torch.uint8)
    padded[:, :columns] = (values.to(torch.int16) + 128).to(torch.uint8)
    shifts = torch.arange(4, dtype=torch.int64) * 8
    words = (padded.reshape(rows, -1, 4).to(torch.int64) << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantization_config(scheme: str, block: tuple[int, int]) -> dict[str, Any]:
    """config.json's quantization_config of a checkpoint quantized by `scheme`."""
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block)}
    int8 = scheme.startswith("int8")
    strategy = {"int8-channel": "channel", "int8-packed": "channel", "int8-group": "group"}.get(scheme, "tensor")
    weights = {"num_bits": 8, "type": "int" if int8 else "float", "strategy": strategy, "symmetric": True,
               "dynamic": False, "group_size": block[1] if strategy == "group" else None, "block_structure": None,
               "actorder": None}
    fmt = {"int8-packed": "pack-quantized"}.get(scheme, "int-quantized" if int8 else "float-quantized")
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}
