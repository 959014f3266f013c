"""Deterministic mode (`ModelConfig.deterministic`): every token's numbers independent of what else runs in
its step, as SGLang's deterministic inference and vLLM's batch invariance promise.

Two things make a token's result depend on its step. A matmul's kernel, and with it the order of its
sums, is chosen by the number of rows (on CPUs fp32 differs between 1 row and 2): here every linear
layer runs on tiles of `TILE_ROWS` rows, the last padded, so each call has the same shape whatever
the batch. And attention: prompts take a prefill kernel (SDPA, chunked matmuls) whose sums differ
from the decode kernel's, so a token's KV and output depend on whether it was prefilled, decoded or
recomputed after a resume; here every query token, prompt tokens included, goes through the decode
kernel over its own context
(`cluster.model.attention.deterministic_backend`). The other ops (norms, rotary, SiLU, the
sampler) work row by row already. The price is speed: `benchmarks.deterministic` measures it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from cluster.model.scaled import ScaledLinear

# Rows per matmul call: a multiple of the kernels' row blocks (so no row takes a tail path); one
# decode row padded to it costs little, the weights' reads dominate there.
TILE_ROWS = 32


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`functional.linear` on tiles of exactly `TILE_ROWS` rows: each row's result the same in any batch."""
    rows = x.shape[0]
    out = x.new_empty((rows, weight.shape[0]))
    tile = x.new_zeros((TILE_ROWS, x.shape[1]))
    for start in range(0, rows, TILE_ROWS):
        count = min(TILE_ROWS, rows - start)
        tile[:count] = x[start:start + count]
        tile[count:] = 0
        out[start:start + count] = functional.linear(tile, weight, bias)[:count]
    return out


class TiledLinear(nn.Linear):
    """An `nn.Linear` computed by `tiled_linear` (its weights, loading and state dict unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return tiled_linear(x, self.weight, self.bias)
        return tiled_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], -1)


class TiledScaledLinear(ScaledLinear):
    """A `ScaledLinear` computed by `tiled_linear` over its widened weight, whatever its scales: its
    one-scale-a-row matmul scales the output after the sums, which would round otherwise than here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        return tiled_linear(rows, self.widened(x.dtype), self.bias).view(*x.shape[:-1], -1)


def tile_linear_layers(model: nn.Module) -> None:
    """Every plain `nn.Linear` and 8-bit `ScaledLinear` of `model` computes by tiles from now on."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = TiledLinear
        elif type(module) is ScaledLinear:
            module.__class__ = TiledScaledLinear
