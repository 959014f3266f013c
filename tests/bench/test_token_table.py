"""The quantized benchmark's requantized file: only the token table changes quantization, every other
tensor and the metadata (tokenizer included) stay as they were."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.quantized import requantize_token_table
from cluster.weights.gguf_packed import read_packed
from cluster.weights.loader import read_gguf
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import write_tiny_gguf
from tests.weights.test_gguf_packed import quantized_names


def test_only_the_token_table_is_requantized(tmp_path: Path) -> None:
    checkpoint = build_tiny_llama_checkpoint(tmp_path / "hf", hidden=64, heads=4, kv_heads=2, tie=True)
    source = write_tiny_gguf(checkpoint, tmp_path / "model.gguf", quantize=quantized_names(2, mixed=False))
    table = requantize_token_table(source, "Q5_0", tmp_path / "table.gguf")
    before, after = read_packed(source), read_packed(table)
    assert (before.qtypes.pop("model.embed_tokens.weight"), after.qtypes.pop("model.embed_tokens.weight")) == \
        ("Q8_0", "Q5_0")
    assert before.qtypes == after.qtypes
    widened_before, widened_after = read_gguf(source), read_gguf(table)
    assert widened_before.hf_config == widened_after.hf_config
    for name, tensor in widened_before.tensors.items():
        if name != "model.embed_tokens.weight":
            assert torch.equal(tensor, widened_after.tensors[name]), name
    torch.testing.assert_close(widened_after.tensors["model.embed_tokens.weight"],
                               widened_before.tensors["model.embed_tokens.weight"], atol=0.05, rtol=0)
