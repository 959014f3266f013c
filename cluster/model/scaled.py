"""Linear layers over 8-bit weights kept so in memory, as a safetensors checkpoint quantized them
(compressed-tensors' int8 and fp8, the fp8 of DeepSeek's and Qwen's block-quantized checkpoints):
int8 or float8_e4m3fn values [out, in] beside float32 scales, one per row and group of columns
[out, groups]. A layer widens its weight into the activations' dtype for its own matmul and drops
it: one layer's weight at a time, never the model's.

    qtype "int8", "fp8"            one scale per row (per-tensor and per-channel checkpoints):
                                   it factors out of each output's sum, so the matmul runs on the
                                   8-bit values widened exactly and the scale multiplies its output
    qtype "int8/128", "fp8/128"    one scale per row and group of 128 columns (group- and
                                   block-quantized checkpoints, blocks repeated over their rows at load)

The weight and its scales are parameters of their own dtypes that `quantize_modules` makes after the
model is cast to the serving dtype, so loading copies into them (fused q/k/v and gate/up row slices
included: rows are independent) and nothing widens them on the way.
"""

from __future__ import annotations

import math

import torch
from torch import nn

STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def is_scaled(qtype: str) -> bool:
    return qtype.partition("/")[0] in STORAGE


def parse_qtype(qtype: str, columns: int) -> tuple[torch.dtype, int]:
    """(the weight's storage dtype, the columns one scale covers) of a qtype, for a layer this wide."""
    storage, _, group = qtype.partition("/")
    if storage not in STORAGE or (group and not group.isdigit()):
        raise ValueError(f"unknown 8-bit qtype {qtype!r}: expected int8 or fp8, optionally /<group columns>")
    return STORAGE[storage], int(group) if group else columns


def widen(weight: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """8-bit values [rows, columns] times their scales [rows, groups] of `group` columns each (the last
    group cut short at the edge), in `dtype` (computed in fp32)."""
    columns = weight.shape[1]
    per_column = scale if scale.shape[1] == 1 else scale.repeat_interleave(group, dim=1)[:, :columns]
    return (weight.float() * per_column).to(dtype)


class ScaledLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, qtype: str, *, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        storage, group = parse_qtype(qtype, in_features)
        self.in_features, self.out_features, self.qtype, self.group = in_features, out_features, qtype, group
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=storage), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, math.ceil(in_features / group)),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale.shape[1] > 1:
            return nn.functional.linear(x, self.widened(x.dtype), self.bias)
        # int8 and e4m3 values are exact in bf16, fp16 and fp32: only the scale rounds, once, in fp32.
        out = (nn.functional.linear(x, self.weight.to(x.dtype)).float() * self.weight_scale[:, 0]).to(x.dtype)
        return out + self.bias if self.bias is not None else out

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """This layer's weight in `dtype`, for one matmul."""
        return widen(self.weight, self.weight_scale, self.group, dtype)
