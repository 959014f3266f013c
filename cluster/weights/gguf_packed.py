"""A GGUF file's weights for a model that keeps them quantized (`cluster.model.quantized`): each 2-D
weight stored as Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K comes out as its packed rows (uint8, [rows, row
bytes]), every other tensor widened to float32, all under Hugging Face names, as `read_gguf` names them.

The model fuses q/k/v and gate/up into one matmul each, so those stay packed only when all their
parts share one kept quantization; otherwise the group is widened (a Q4_K_M file's mixed types).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cluster.weights import loader
from cluster.weights.loader import Checkpoint

KEPT = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"})
# The model's fused parameters and the checkpoint tensors that load into them.
FUSED = {".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
         ".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj.")}


@dataclass(slots=True)
class PackedGGUF:
    """`qtypes`: the model's parameter names kept packed, with their quantization (what
    `quantize_modules` swaps); `tensors()`: every checkpoint tensor, packed or widened."""

    path: Path
    qtypes: dict[str, str]
    kept: dict[str, str]  # checkpoint (Hugging Face) names yielded packed, with their quantization

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        import gguf

        reader = gguf.GGUFReader(str(self.path))
        metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
        architecture = str(metadata["general.architecture"])
        heads = int(metadata[f"{architecture}.attention.head_count"])
        kv_heads = int(metadata.get(f"{architecture}.attention.head_count_kv", heads))
        permutes = loader.permutes_qk(architecture)
        for tensor in reader.tensors:
            name = loader.hf_name_for_gguf_tensor(tensor.name)
            values: np.ndarray = tensor.data if name in self.kept else loader.dequantize_tensor(tensor)
            if permutes and ".q_proj." in name:
                values = loader.unpermute_from_gguf(values, heads)
            elif permutes and ".k_proj." in name:
                values = loader.unpermute_from_gguf(values, kv_heads)
            # A fresh, writable copy: the reader's arrays are views of a read-only memory map.
            yield name, torch.from_numpy(np.array(values, order="C"))


def packed_checkpoint(checkpoint: Checkpoint, gguf_path: Path) -> Checkpoint:
    """`checkpoint` (the GGUF file's conversion: its config and tokenizer) with its weights read from
    `gguf_path` itself, those a model can compute packed kept so."""
    packed = read_packed(gguf_path)
    return dataclasses.replace(checkpoint, weights=packed.tensors, quantized=packed.qtypes)


def read_packed(path: Path) -> PackedGGUF:
    """Which of `path`'s weights stay packed, decided from its tensors' types (no data read)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    types = {loader.hf_name_for_gguf_tensor(t.name): t.tensor_type.name for t in reader.tensors
             if len(t.shape) == 2}
    kept = {name: qtype for name, qtype in types.items() if qtype in KEPT}
    qtypes: dict[str, str] = {}
    for name in sorted(kept):
        fused = fused_name(name)
        if fused is None:
            qtypes[name] = types[name]
            continue
        parts = fused_parts(fused)
        if len({types.get(part) for part in parts}) == 1:
            qtypes[fused] = types[name]
        else:  # mixed quantizations cannot share one packed matmul: widen them all
            for part in parts:
                kept.pop(part, None)
    return PackedGGUF(Path(path), qtypes, kept)


def fused_name(name: str) -> str | None:
    for fused, parts in FUSED.items():
        for part in parts:
            if part in name:
                return name.replace(part, fused)
    return None


def fused_parts(name: str) -> list[str]:
    fused = next(key for key in FUSED if key in name)
    return [name.replace(fused, part) for part in FUSED[fused]]
