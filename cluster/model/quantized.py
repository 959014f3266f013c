"""GGUF-quantized weights kept packed in memory (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), as llama.cpp
keeps them: a linear layer or an embedding holds its rows as their blocks (of 32 weights, the K-quants'
super-blocks of 256) as uint8, and widens them only when it computes.

- `QuantizedLinear`: a decode step's few rows go through the C kernel that dots each block with the
  activations as it widens it (`pdserve_kernels.cpu_quant`); more rows (a prefill) widen the layer's
  weight into the activations' dtype for one torch matmul, then drop it: one layer's weight at a
  time, never the model's.
- `QuantizedEmbedding`: widens only the rows of the step's tokens.

The packed rows are a uint8 `weight` parameter of shape [rows, row bytes], so a checkpoint loader
copies them (fused shards included: rows are independent) as it copies float weights, and
`Module.to(dtype)` leaves them alone. `quantize_modules` swaps a built model's layers for these, and
for the 8-bit layers of safetensors checkpoints (`cluster.model.scaled`).
"""

from __future__ import annotations

import torch
from torch import nn

from cluster.model.scaled import ScaledLinear, is_scaled
from pdserve_kernels import cpu_quant

BLOCK_WEIGHTS = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
# Where a 32-weight block keeps its fp16 min (after the scale) and its 4-bit q (its 5th bits, Q5's, before them).
HAS_MIN = frozenset({"Q4_1", "Q5_1"})
KERNEL_ROWS = 16  # up to this many rows the C kernel beats widening the weight for torch's matmul


def row_bytes(columns: int, qtype: str) -> int:
    weights = BLOCK_WEIGHTS[qtype]
    if columns % weights:
        raise ValueError(f"{qtype} rows hold whole blocks of {weights} weights; {columns} columns do not")
    return columns // weights * BLOCK_BYTES[qtype]


def dequantize(packed: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows [rows, row bytes] (uint8) widened to [rows, columns] in `dtype`."""
    rows = packed.shape[0]
    blocks = packed.reshape(rows, -1, BLOCK_BYTES[qtype])
    if qtype in ("Q4_K", "Q5_K"):
        return _dequantize_q4_k_q5_k(blocks, qtype == "Q5_K").reshape(rows, -1).to(dtype)
    if qtype == "Q6_K":
        return _dequantize_q6_k(blocks).reshape(rows, -1).to(dtype)
    scale = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if qtype == "Q8_0":
        values = blocks[..., 2:].contiguous().view(torch.int8).float() * scale
    else:
        q = _four_bit_values(blocks, 4 if qtype in HAS_MIN else 2, qtype.startswith("Q5"))
        if qtype in HAS_MIN:
            values = q * scale + blocks[..., 2:4].contiguous().view(torch.float16).float()
        else:  # signed q stored with an offset of half its range
            values = q * scale - (16.0 if qtype == "Q5_0" else 8.0) * scale
    return values.reshape(rows, -1).to(dtype)


def _four_bit_values(blocks: torch.Tensor, start: int, fifth_bit: bool) -> torch.Tensor:
    """A 32-weight block's unsigned q: byte j's low nibble is weight j, its high nibble weight j + 16; Q5's
    4 bytes before them hold each weight's 5th bit, bit j of their little-endian 32 bits for weight j."""
    nibbles = blocks[..., start + 4 if fifth_bit else start:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.int32)
    if fifth_bit:
        high = blocks[..., start:start + 4].to(torch.int32)
        # [..., 4 bytes, 8 bits]
        bits = (high.unsqueeze(-1) >> torch.arange(8, dtype=torch.int32, device=high.device)) & 1
        q = q | (bits.flatten(-2) << 4)
    return q.float()


def _dequantize_q4_k_q5_k(blocks: torch.Tensor, fifth_bit: bool) -> torch.Tensor:
    """Q4_K super-blocks [rows, n, 144] (Q5_K's [rows, n, 176]) to [rows, n, 256]: eight sub-blocks of 32,
    each d * scale_i * q - dmin * min_i with 6-bit scales and mins packed as llama.cpp packs them in 12
    bytes after fp16 d and dmin. Q5_K's 32 bytes qh come next: sub-block i's 5th bits are bit i of them."""
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    packed = blocks[..., 4:16].to(torch.int32)
    low = torch.cat([packed[..., 0:4] & 63, (packed[..., 8:12] & 0x0F) | ((packed[..., 0:4] >> 6) << 4)], dim=-1)
    mins = torch.cat([packed[..., 4:8] & 63, (packed[..., 8:12] >> 4) | ((packed[..., 4:8] >> 6) << 4)], dim=-1)
    start = 48 if fifth_bit else 16
    q = blocks[..., start:].reshape(*blocks.shape[:-1], 4, 32)  # 4 runs of 32 bytes: sub-blocks 2i (low), 2i+1 (high)
    nibbles = torch.stack([q & 0x0F, q >> 4], dim=-2).reshape(*blocks.shape[:-1], 8, 32)
    if fifth_bit:
        qh = blocks[..., 16:48].unsqueeze(-2)  # [..., 1, 32]
        nibbles = nibbles | (((qh >> _shifts(list(range(8)), qh.device)) & 1) << 4)
    return (nibbles.float() * (d * low.float()).unsqueeze(-1) - (dmin * mins.float()).unsqueeze(-1)).flatten(-2)


def _dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [rows, n, 210] to [rows, n, 256]: 128 bytes ql (low 4 bits), 64 bytes qh (high 2
    bits), 16 int8 scales (one per 16 weights), fp16 d; w = d * scale_i * (q - 32). Each half of 128
    weights takes 64 bytes of ql and 32 of qh: its 32-weight run r is ql's bytes 32 * (r % 2) on, their
    low nibbles for r < 2, high ones after, and bits 2r, 2r + 1 of qh's 32 bytes."""
    shape = blocks.shape[:-1]
    d = blocks[..., 208:210].contiguous().view(torch.float16).float()
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
    ql = blocks[..., 0:128].reshape(*shape, 2, 1, 64) >> _shifts([0, 4], blocks.device)
    ql = (ql & 0x0F).reshape(*shape, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(*shape, 2, 1, 32) >> _shifts([0, 2, 4, 6], blocks.device)
    q = (ql | ((qh & 3) << 4)).to(torch.int32) - 32
    return (q.reshape(*shape, 16, 16).float() * (d * scales).unsqueeze(-1)).flatten(-2)


def _shifts(bits: list[int], device: torch.device) -> torch.Tensor:
    """A column of shifts [len(bits), 1] on the packed bytes' device: each one's run of bytes shifted by each."""
    return torch.tensor(bits, dtype=torch.uint8, device=device).unsqueeze(-1)


class QuantizedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, qtype: str, bias: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, qtype
        self.weight = nn.Parameter(torch.zeros(out_features, row_bytes(in_features, qtype), dtype=torch.uint8),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= KERNEL_ROWS and rows.device.type == "cpu" and cpu_quant.available():
            out = cpu_quant.matmul(rows.float().contiguous(), self.weight, self.qtype).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
        else:
            out = nn.functional.linear(rows, self.widened(x.dtype, x.device), self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


    def widened(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This layer's weight in `dtype`, for one matmul: by the C kernel where it serves, else torch."""
        if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_quant.available():
            return cpu_quant.widen(self.weight, self.qtype, self.in_features, dtype)
        return dequantize(self.weight, self.qtype, dtype)


class QuantizedEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, qtype: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype, self.dtype = qtype, dtype
        self.weight = nn.Parameter(torch.zeros(num_embeddings, row_bytes(embedding_dim, qtype), dtype=torch.uint8),
                                   requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.weight[token_ids.reshape(-1)], self.qtype, self.dtype).reshape(*token_ids.shape, -1)


def quantize_modules(model: nn.Module, qtypes: dict[str, str], dtype: torch.dtype) -> None:
    """Swap each `nn.Linear` / `nn.Embedding` whose weight is named in `qtypes` (parameter name ->
    qtype: a GGUF quantization, or `cluster.model.scaled`'s int8/fp8) for its quantized counterpart,
    in place, its float parameters (biases) in `dtype`; weights tied to one parameter stay tied."""
    swapped: dict[str, nn.Parameter] = {}
    for name, module in list(model.named_modules()):
        qtype = qtypes.get(f"{name}.weight")
        if qtype is None:
            continue
        replacement = _quantized(name, module, qtype, dtype)
        if replacement is None:
            continue
        parent_name, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attribute, replacement)
        swapped[f"{name}.weight"] = replacement.get_parameter("weight")
    _retie(model, swapped)


def _quantized(name: str, module: nn.Module, qtype: str,
               dtype: torch.dtype) -> QuantizedLinear | QuantizedEmbedding | ScaledLinear | None:
    """The quantized counterpart of `module`, None for a module with none."""
    if is_scaled(qtype):
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name} is a {type(module).__name__}: 8-bit {qtype} weights are kept for linear "
                             "layers only")
        return ScaledLinear(module.in_features, module.out_features, qtype, bias=module.bias is not None,
                            dtype=dtype)
    if isinstance(module, nn.Linear):
        return QuantizedLinear(module.in_features, module.out_features, qtype, module.bias is not None, dtype)
    if isinstance(module, nn.Embedding):
        return QuantizedEmbedding(module.num_embeddings, module.embedding_dim, qtype, dtype)
    return None


def _retie(model: nn.Module, swapped: dict[str, nn.Parameter]) -> None:
    """An lm_head tied to quantized embeddings becomes a QuantizedLinear over the same packed rows."""
    lm_head, embed = getattr(model, "lm_head", None), swapped.get("model.embed_tokens.weight")
    if embed is None or not isinstance(lm_head, nn.Linear) or "lm_head.weight" in swapped:
        return
    embeddings = model.get_submodule("model.embed_tokens")
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and \
            isinstance(embeddings, QuantizedEmbedding):
        head = QuantizedLinear(lm_head.in_features, lm_head.out_features, embeddings.qtype)
        head.weight = embed
        model.lm_head = head
