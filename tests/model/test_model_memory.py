"""Weights are allocated once, in the dtype they serve in: a bf16 model never passes through fp32 on
its device (an 8B model built in fp32 and then cast would peak at 32 GB plus 16, held by the allocator)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster.weights.synthetic import build_random_llama

ROOT = Path(__file__).resolve().parents[2]
# Resets the process's peak resident memory (VmHWM) just before the model is built, then reports how
# far above the resident memory of that moment the build went.
MEASURE = """
import json, sys
import torch
from cluster.model.registry import architecture_config
from cluster.model.attention.registry import get_attention_backend
from cluster.model.runner import ModelRunner, keep_freed_host_memory
from cluster.weights.loader import iterate_safetensors, load_hf_config

def status(key):
    line = next(line for line in open("/proc/self/status") if line.startswith(key + ":"))
    return int(line.split()[1]) * 1024

path = sys.argv[1]
arch = architecture_config(load_hf_config(path))
# Before the measure: the checkpoint's tensors copied out of their file mapping (whose pages count as
# resident once read) and the attention kernels loaded, so that only what the build allocates counts.
weights = [(name, tensor.clone()) for name, tensor in iterate_safetensors(path)]
get_attention_backend("torch", torch.device("cpu"))
keep_freed_host_memory()
with open("/proc/self/clear_refs", "w") as handle:
    handle.write("5")
before = status("VmRSS")
runner = ModelRunner(arch, weights, dtype="bfloat16", device="cpu", attention_backend="torch",
                     max_model_len=64, block_size=16, num_blocks=4)
size = sum(p.numel() * p.element_size() for p in runner.model.parameters())
print(json.dumps({"peak": status("VmHWM") - before, "weights": size}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 130 MB of fp32 weights in tensors of at most 5 MB: the fp32 copy would be plain to see."""
    return build_random_llama(tmp_path_factory.mktemp("mid"), num_layers=6, hidden_size=768, num_heads=12,
                              num_kv_heads=6, vocab_size=320)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak-RSS reset")
def test_bf16_model_peaks_at_its_bf16_size(checkpoint: Path) -> None:
    result = subprocess.run([sys.executable, "-c", MEASURE, str(checkpoint)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["weights"] > 50 * 2**20
    # bf16 weights plus a checkpoint tensor in flight and allocator slack; built in fp32 and then cast,
    # the peak is fp32's size plus bf16's (3x).
    assert measured["peak"] < 1.3 * measured["weights"], measured


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_model_on_cuda_peaks_at_its_bf16_size(checkpoint: Path) -> None:
    from cluster.model.registry import architecture_config
    from cluster.model.runner import ModelRunner
    from cluster.weights.loader import iterate_safetensors, load_hf_config

    arch = architecture_config(load_hf_config(checkpoint))
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    runner = ModelRunner(arch, iterate_safetensors(checkpoint), dtype="bfloat16", device="cuda",
                         attention_backend="torch", max_model_len=64, block_size=16, num_blocks=4)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert torch.cuda.max_memory_allocated() - start < 1.25 * weights + 8 * 2**20
