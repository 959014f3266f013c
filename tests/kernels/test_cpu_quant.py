"""GGUF-quantized weights kept packed: torch's widening equals gguf's own dequantization byte for
byte, and the C kernel's matmul over packed rows equals a matmul over the widened weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.model.quantized import QuantizedEmbedding, QuantizedLinear, dequantize, quantize_modules
from pdserve_kernels import cpu_quant

QTYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K", "Q5_K"]
# gguf's Python cannot quantize to K-quants: their super-blocks' bytes, where their fp16 d (and dmin) sit,
# and values for those, so that random q and scales give weights of Q4_K's magnitude (up to about 2):
# Q5_K's q reach twice Q4_K's, Q6_K's int8 scales and 6-bit q four times.
SUPER_BLOCKS = {"Q4_K": (144, 0, [0.002, 0.001]), "Q5_K": (176, 0, [0.001, 0.001]), "Q6_K": (210, 208, [0.0005])}


def packed(rows: int, columns: int, qtype: str, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Random weights quantized by gguf: (packed rows as uint8, gguf's own dequantization)."""
    import gguf.quants
    from gguf.constants import GGMLQuantizationType

    kind = GGMLQuantizationType[qtype]
    generator = np.random.default_rng(seed)
    if qtype in SUPER_BLOCKS:  # random super-blocks, their d and dmin kept finite and small
        size, at, scales = SUPER_BLOCKS[qtype]
        data = generator.integers(0, 256, (rows, columns // 256, size), dtype=np.uint8)
        data[..., at:at + 2 * len(scales)] = np.frombuffer(np.array(scales, dtype=np.float16).tobytes(), dtype=np.uint8)
        data = data.reshape(rows, -1)
    else:
        data = gguf.quants.quantize(generator.standard_normal((rows, columns)).astype(np.float32), kind)
    return torch.from_numpy(np.ascontiguousarray(data)), gguf.quants.dequantize(data, kind)


@pytest.mark.parametrize("qtype", QTYPES)
def test_widening_equals_gguf_dequantization(qtype: str) -> None:
    rows, expected = packed(24, 512, qtype)
    assert torch.equal(dequantize(rows, qtype), torch.from_numpy(expected))


@pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
def test_the_kernel_equals_a_matmul_over_the_widened_weights(qtype: str, rows: int) -> None:
    weights, _ = packed(40, 256, qtype, seed=1)
    x = torch.randn(rows, 256)
    expected = x @ dequantize(weights, qtype).T
    torch.testing.assert_close(cpu_quant.matmul(x, weights, qtype), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_layers_compute_what_their_widened_weights_do(qtype: str, dtype: torch.dtype) -> None:
    weights, widened = packed(48, 256, qtype, seed=2)
    linear = QuantizedLinear(256, 48, qtype)
    linear.weight.data.copy_(weights)
    reference = torch.from_numpy(widened)
    atol, rtol = (0.1, 0.02) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    generator = torch.Generator().manual_seed(0)  # some draws of x put an output near 0 past bf16's tolerance
    for rows in (2, 40):  # the C kernel's rows, then torch's matmul
        x = torch.randn(rows, 256, generator=generator).to(dtype)
        out = linear(x)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), x.float() @ reference.T, atol=atol, rtol=rtol)
    embedding = QuantizedEmbedding(48, 256, qtype, dtype)
    embedding.weight.data.copy_(weights)
    ids = torch.tensor([[3, 47, 3]])
    assert torch.equal(embedding(ids), reference.to(dtype)[ids])


def test_quantize_modules_swaps_named_layers_and_keeps_tied_heads_tied() -> None:
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"tie_word_embeddings": True})()
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(40, 64)
            self.model.proj = torch.nn.Linear(64, 32, bias=False)
            self.model.norm = torch.nn.Linear(64, 64)
            self.lm_head = torch.nn.Linear(64, 40, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight

    model = Tiny()
    quantize_modules(model, {"model.embed_tokens.weight": "Q8_0", "model.proj.weight": "Q4_1"}, torch.float32)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and isinstance(model.model.proj, QuantizedLinear)
    assert isinstance(model.model.norm, torch.nn.Linear)  # not named: left as it was
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.proj.weight.dtype == torch.uint8 and model.model.proj.weight.shape == (32, 40)
    model.to(torch.bfloat16)
    assert model.model.proj.weight.dtype == torch.uint8


@pytest.mark.skipif(not cpu_quant.available(), reason="no C compiler")
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_kernels_widening_equals_torchs(qtype: str) -> None:
    weights, _ = packed(24, 512, qtype, seed=3)
    assert torch.equal(cpu_quant.widen(weights, qtype, 512, torch.float32), dequantize(weights, qtype))
    assert torch.equal(cpu_quant.widen(weights, qtype, 512, torch.bfloat16), dequantize(weights, qtype, torch.bfloat16))
