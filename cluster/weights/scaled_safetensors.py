"""Safetensors checkpoints quantized to 8 bits, read for a model that keeps them so
(`cluster.model.scaled`), recognised as vLLM recognises them, by config.json's `quantization_config`:

- `quant_method: compressed-tensors` (llm-compressor's output): formats `int-quantized` and
  `naive-quantized` (int8 `weight`), `pack-quantized` of 8 bits (four int8 values offset by 128 in each
  int32 of `weight_packed`, lowest byte first, its [rows, columns] in `weight_shape`) and
  `float-quantized` (float8_e4m3fn `weight`); symmetric scales `weight_scale` per tensor, per channel
  ([rows, 1]), per group of columns ([rows, columns / group]) or per block ([row blocks, column blocks]).
- `quant_method: fp8` (DeepSeek V3, Qwen3 FP8): float8_e4m3fn `weight` with `weight_scale_inv`, per
  `weight_block_size` block ([row blocks, column blocks]; despite its name, a multiplier like the
  others), or without blocks one `weight_scale` per tensor.

Each quantized weight comes out as its 8-bit values [rows, columns] and a `weight_scale` in float32 of
one scale per row and group of columns [rows, groups], whatever the checkpoint's granularity: a
per-tensor scale repeated down the rows, a block's down its block's rows. That is the layout whose row
slices a fused q/k/v or gate/up parameter loads, each part with its own scales. Every other tensor
comes out as stored. What the model cannot compute exactly as the checkpoint means it is refused by
name: other bit widths, zero points, activation-ordered groups, per-token weight scales, quantized
KV caches, other formats and methods.

Activations: a checkpoint that quantizes them too (W8A8, fp8 "dynamic") is computed here with them
unquantized, as vLLM computes it on hardware without 8-bit matmuls, and a warning says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.common.errors import ModelLoadError
from cluster.weights.gguf_packed import fused_name, fused_parts
from cluster.weights.loader import Checkpoint

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

METHODS = ("compressed-tensors", "fp8")
FORMATS = {"int-quantized": "int", "naive-quantized": "int", "pack-quantized": "int", "float-quantized": "float"}
STRATEGIES = ("tensor", "channel", "group", "block")
# The checkpoint tensors beside a quantized weight that the model reads no further.
SKIPPED = ("input_scale", "weight_zero_point", "weight_shape")


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """How a checkpoint's quantized weights are stored and scaled."""

    method: str  # "compressed-tensors" or "fp8"
    storage: str  # "int8" or "fp8"
    strategy: str  # "tensor", "channel", "group" or "block"
    block: tuple[int, int] | None = None  # "block": rows and columns one scale covers
    group_size: int | None = None  # "group": the columns one scale covers
    packed: bool = False  # compressed-tensors' pack-quantized: int8 values four to an int32

    @property
    def qtype(self) -> str:
        """`cluster.model.scaled`'s name for a layer's weights: its storage, and its scale group's columns
        where it has more than one group a row."""
        columns = self.block[1] if self.block else self.group_size
        return f"{self.storage}/{columns}" if columns else self.storage


def quantization_method(hf_config: dict[str, Any]) -> str | None:
    """config.json's `quantization_config.quant_method`, None for a float checkpoint."""
    config = hf_config.get("quantization_config")
    return None if not config else str(config.get("quant_method"))


def read_scheme(hf_config: dict[str, Any]) -> WeightScheme | None:
    """The weight scheme config.json declares, None where it declares none; a `ModelLoadError` naming what
    is not supported."""
    config = hf_config.get("quantization_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    if method == "fp8":
        return _fp8_scheme(config)
    raise ModelLoadError(f"quantization_config quant_method {method!r} is not supported; kept 8-bit: "
                         f"{', '.join(METHODS)} (int8 or fp8 weights); a GGUF file: --quantization gguf")


def _fp8_scheme(config: dict[str, Any]) -> WeightScheme:
    if config.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"fp8 checkpoints of format {config['fmt']!r} are not supported: e4m3 only")
    block = config.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ModelLoadError(f"fp8 weight_block_size must be [rows, columns], got {block!r}")
    _warn_activations("fp8", config.get("activation_scheme"))
    if block is None:
        return WeightScheme("fp8", "fp8", "tensor")
    return WeightScheme("fp8", "fp8", "block", block=(int(block[0]), int(block[1])))


def _compressed_tensors_scheme(config: dict[str, Any]) -> WeightScheme:
    if config.get("kv_cache_scheme"):
        raise ModelLoadError("compressed-tensors kv_cache_scheme (a quantized KV cache with its scales) is not "
                             "supported: serve the weights of a checkpoint without it, and --kv-cache-dtype fp8")
    if (config.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise ModelLoadError(f"compressed-tensors sparsity format {config['sparsity_config']['format']!r} "
                             "is not supported")
    groups = config.get("config_groups") or {}
    schemes = {_group_scheme(group, group.get("format") or config.get("format")) for group in groups.values()}
    if len(schemes) != 1:
        raise ModelLoadError(f"compressed-tensors config_groups with {len(schemes)} weight schemes: "
                             "one scheme for every quantized layer is supported")
    return schemes.pop()


def _group_scheme(group: dict[str, Any], storage_format: str | None) -> WeightScheme:
    """One compressed-tensors config group's weight scheme."""
    weights = group.get("weights") or {}
    kind = weights.get("type", "int")
    if storage_format not in FORMATS:
        raise ModelLoadError(f"compressed-tensors format {storage_format!r} is not supported; supported: "
                             f"{', '.join(FORMATS)} of 8 bits")
    if weights.get("num_bits") != 8:
        raise ModelLoadError(f"compressed-tensors {weights.get('num_bits')}-bit weights are not supported: "
                             "8-bit int or float only")
    if FORMATS[storage_format] != kind:
        raise ModelLoadError(f"compressed-tensors {kind} weights in format {storage_format!r}")
    _check_weight_args(weights)
    _warn_activations("compressed-tensors", group.get("input_activations"))
    strategy = weights.get("strategy", "tensor")
    block = weights.get("block_structure") or (0, 0)
    return WeightScheme("compressed-tensors", "int8" if kind == "int" else "fp8", strategy,
                        block=(int(block[0]), int(block[1])) if strategy == "block" else None,
                        group_size=int(weights["group_size"]) if strategy == "group" else None,
                        packed=storage_format == "pack-quantized")


def _check_weight_args(weights: dict[str, Any]) -> None:
    strategy = weights.get("strategy", "tensor")
    if strategy not in STRATEGIES:
        raise ModelLoadError(f"compressed-tensors weight strategy {strategy!r} is not supported; supported: "
                             f"{', '.join(STRATEGIES)}")
    if not weights.get("symmetric", True):
        raise ModelLoadError("compressed-tensors asymmetric weights (zero points) are not supported: symmetric only")
    if weights.get("actorder"):
        raise ModelLoadError(f"compressed-tensors actorder {weights['actorder']!r} (activation-ordered groups) is "
                             "not supported")
    if weights.get("dynamic"):
        raise ModelLoadError("compressed-tensors dynamic weight scales are not supported")
    if strategy == "group" and not weights.get("group_size"):
        raise ModelLoadError("compressed-tensors strategy 'group' without a group_size")
    if strategy == "block" and len(weights.get("block_structure") or ()) != 2:
        raise ModelLoadError("compressed-tensors strategy 'block' without a [rows, columns] block_structure")


def _warn_activations(method: str, activations: object) -> None:
    if activations:
        log.warning("this %s checkpoint quantizes activations too (%s): its weights are kept 8-bit, its "
                    "activations are computed unquantized, in the model's dtype", method, activations)


# --------------------------------------------------------------------------------------------------
# Reading


@dataclass(slots=True)
class ScaledSafetensors:
    """`qtypes`: the model's parameter names kept 8-bit (what `quantize_modules` swaps); `tensors()`:
    every checkpoint tensor, quantized weights with their scales as the model holds them."""

    directory: Path
    scheme: WeightScheme
    qtypes: dict[str, str]
    shapes: dict[str, tuple[int, int]]  # each quantized layer's (checkpoint prefix) weight [rows, columns]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for path in sorted(self.directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    yield from self._converted(name, handle.get_tensor(name))

    def _converted(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        prefix, _, kind = name.rpartition(".")
        if prefix not in self.shapes:
            yield name, tensor
        elif kind in ("weight_scale", "weight_scale_inv"):
            yield f"{prefix}.weight_scale", row_scales(tensor, self.shapes[prefix], self.scheme, name)
        elif kind in ("weight", "weight_packed"):
            yield f"{prefix}.weight", self._values(name, tensor)
        elif kind not in SKIPPED:
            raise ModelLoadError(f"checkpoint tensor {name!r} beside a quantized weight is not supported")

    def _values(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        import torch

        if self.scheme.packed:
            tensor = unpack_int8(tensor, self.shapes[name.rpartition(".")[0]][1])
        expected = torch.int8 if self.scheme.storage == "int8" else torch.float8_e4m3fn
        if tensor.dtype != expected:
            raise ModelLoadError(f"checkpoint tensor {name!r} is {tensor.dtype}; this {self.scheme.method} "
                                 f"checkpoint's weights are {expected}")
        return tensor


def unpack_int8(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """pack-quantized int32 words [rows, ceil(columns / 4)] to their int8 values [rows, columns]: the words'
    bytes in memory order (little-endian: lowest first), each offset by 128."""
    import torch

    values = packed.contiguous().view(torch.uint8).reshape(packed.shape[0], -1)[:, :columns]
    return (values ^ 0x80).view(torch.int8)  # x + 128 mod 256 undone: flip the top bit


def row_scales(scale: torch.Tensor, shape: tuple[int, int], scheme: WeightScheme, name: str) -> torch.Tensor:
    """A checkpoint's scales of one weight [rows, columns] as one float32 scale per row and group of
    columns, [rows, groups] (module docstring); a `ModelLoadError` where their shape is not the scheme's."""
    import torch

    rows, columns = shape
    scale = scale.float()
    if scale.numel() == 1:  # per tensor, whatever the strategy says: vLLM reads a single scale so too
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    grid = _scale_grid(scheme, rows, columns)
    if tuple(scale.shape) != grid and not (scheme.strategy == "channel" and tuple(scale.shape) == (rows,)):
        raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(scale.shape)}; a {scheme.strategy} "
                             f"scale of a [{rows}, {columns}] weight has {grid}")
    if scheme.strategy == "block" and scheme.block is not None:
        return torch.repeat_interleave(scale, scheme.block[0], dim=0)[:rows].contiguous()
    return scale.reshape(rows, -1).contiguous()


def _scale_grid(scheme: WeightScheme, rows: int, columns: int) -> tuple[int, int]:
    if scheme.block is not None:
        return math.ceil(rows / scheme.block[0]), math.ceil(columns / scheme.block[1])
    if scheme.group_size is not None:
        return rows, math.ceil(columns / scheme.group_size)
    return (rows, 1) if scheme.strategy == "channel" else (1, 1)


def read_scaled(directory: Path, scheme: WeightScheme) -> ScaledSafetensors:
    """Which layers of `directory`'s checkpoint are quantized, from its tensors' names and shapes (no
    data read): those stored with a scale."""
    headers = _headers(directory)
    shapes: dict[str, tuple[int, int]] = {}
    for name in headers:
        prefix, _, kind = name.rpartition(".")
        if kind in ("weight_scale", "weight_scale_inv"):
            shapes[prefix] = _weight_shape(headers, prefix)
    return ScaledSafetensors(Path(directory), scheme, _model_qtypes(shapes, scheme.qtype), shapes)


def _headers(directory: Path) -> dict[str, tuple[Path, list[int]]]:
    """Every tensor's file and shape (no data read)."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {directory}")
    headers: dict[str, tuple[Path, list[int]]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                headers[name] = (path, list(handle.get_slice(name).get_shape()))
    return headers


def _weight_shape(headers: dict[str, tuple[Path, list[int]]], prefix: str) -> tuple[int, int]:
    if ".experts." in prefix:
        raise ModelLoadError(f"{prefix}: 8-bit mixture-of-experts expert weights are not supported (experts "
                             "compute from stacked float weights)")
    if f"{prefix}.weight_shape" in headers:  # pack-quantized: the shape is a tensor's data
        return _packed_shape(headers[f"{prefix}.weight_shape"][0], prefix)
    _, shape = headers.get(f"{prefix}.weight", (None, []))
    if len(shape) != 2:
        raise ModelLoadError(f"checkpoint has a scale for {prefix} but no 2-D {prefix}.weight")
    return int(shape[0]), int(shape[1])


def _packed_shape(path: Path, prefix: str) -> tuple[int, int]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        shape = [int(size) for size in handle.get_tensor(f"{prefix}.weight_shape").tolist()]
    if len(shape) != 2:
        raise ModelLoadError(f"{prefix}.weight_shape must hold [rows, columns], got {shape}")
    return shape[0], shape[1]


def _model_qtypes(shapes: dict[str, tuple[int, int]], qtype: str) -> dict[str, str]:
    """The model's parameters (q/k/v and gate/up fused) kept 8-bit; a fused one must have all its parts so."""
    qtypes: dict[str, str] = {}
    for prefix in shapes:
        name = f"{prefix}.weight"
        fused = fused_name(name)
        if fused is not None:
            missing = [part for part in fused_parts(fused) if part.removesuffix(".weight") not in shapes]
            if missing:
                raise ModelLoadError(f"{name} is quantized but {missing[0]} is not: a fused layer's parts "
                                     "must be quantized alike")
        qtypes[fused or name] = qtype
    return qtypes


def scaled_checkpoint(checkpoint: Checkpoint, directory: Path, requested: str) -> Checkpoint:
    """`checkpoint` with its 8-bit weights kept so where its config.json declares a quantization.

    `requested` (`--quantization`) may name that method or be left at "none", as vLLM's flag; naming a
    method the checkpoint does not declare is a ValueError."""
    declared = quantization_method(checkpoint.hf_config)
    if requested in METHODS and declared is None:
        raise ValueError(f"quantization {requested!r} keeps a quantized checkpoint 8-bit; {directory}'s config.json "
                         "has no quantization_config")
    if requested not in ("none", declared) and declared is not None:
        raise ValueError(f"quantization {requested!r} was asked for; {directory}'s config.json declares "
                         f"{declared!r}")
    scheme = read_scheme(checkpoint.hf_config)
    if scheme is None:
        return checkpoint
    scaled = read_scaled(directory, scheme)
    return dataclasses.replace(checkpoint, weights=scaled.tensors, quantized=scaled.qtypes)
