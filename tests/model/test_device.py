"""Which device an engine runs on: `device: auto|cpu|cuda[:N]`, refused clearly where it cannot be."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.model.device import resolve_device
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_auto_and_cpu_resolve_to_the_cpu_here() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_refused_with_what_to_change(spec: str) -> None:
    with pytest.raises(ValueError, match="sees no CUDA device.*use device cpu"):
        resolve_device(spec)


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "CPU", "cuda:x", "mps"])
def test_unknown_devices_are_refused_by_the_config(spec: str) -> None:
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        ModelConfig(device=spec)


def test_the_default_is_auto() -> None:
    assert ModelConfig().device == "auto"


@no_cuda
def test_an_engine_on_a_missing_gpu_refuses_before_loading(tmp_path: Path) -> None:
    checkpoint = build_tiny_llama_checkpoint(tmp_path / "tiny")
    with pytest.raises(ValueError, match="sees no CUDA device"):
        LLMEngine(EngineConfig(model=fp32_model(checkpoint, device="cuda"),
                               cache=CacheConfig(block_size=4, num_blocks=16)))


def test_an_engine_on_auto_runs_where_auto_points(tmp_path: Path) -> None:
    checkpoint = build_tiny_llama_checkpoint(tmp_path / "tiny")
    engine = LLMEngine(EngineConfig(model=fp32_model(checkpoint), cache=CacheConfig(block_size=4,
                                                                                                num_blocks=16)))
    assert engine.device == resolve_device("auto")
    assert engine.runner.kv_caches[0].device.type == engine.device.type
