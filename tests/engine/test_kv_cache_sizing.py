"""How big an engine's KV cache is: `num_blocks`, else `kv_cache_memory_gb` where set, else on a device
that reports its memory what `gpu_memory_utilization` of it leaves after the weights and the largest
step's activations (vLLM's sizing), else (a CPU) `cpu_kv_cache_memory_gb`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.model.memory import GIB, MARGIN_BYTES, MemoryProfile, check_free
from cluster.model.runner import DTYPES, kv_block_bytes
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

MIB = 2**20


@dataclass
class ReportedMemory:
    """A device's memory as a test states it: what the driver reports, and the peak of the profiled step."""

    free: int
    total: int
    peak: int
    profiled: list[int] = field(default_factory=list)  # calls of peak_during

    def free_and_total(self) -> tuple[int, int]:
        return self.free, self.total

    def peak_during(self, run: Callable[[], object]) -> int:
        run()
        self.profiled.append(1)
        return self.peak


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def engine(checkpoint: Path, memory: ReportedMemory | None = None, **cache: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=fp32_model(checkpoint, device="cpu"), cache=CacheConfig(**cache),  # type: ignore[arg-type]
                                  scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)),
                     memory=memory)


def block_bytes(engine: LLMEngine) -> int:
    return kv_block_bytes(engine.arch, engine.config.cache.block_size, DTYPES[engine.kv_cache_dtype])


# ---- the arithmetic ---------------------------------------------------------------------------------

def test_kv_cache_takes_what_the_utilization_leaves() -> None:
    profile = MemoryProfile(utilization=0.9, total=80 * GIB, weights=16 * GIB, peak_activations=3 * GIB)
    assert profile.kv_cache_bytes == int(0.9 * 80 * GIB) - 16 * GIB - 3 * GIB - MARGIN_BYTES


def test_a_share_too_small_for_weights_and_a_step_is_refused_saying_what_to_change() -> None:
    profile = MemoryProfile(utilization=0.2, total=80 * GIB, weights=15 * GIB, peak_activations=1 * GIB)
    with pytest.raises(ValueError, match="raise gpu_memory_utilization, lower max_num_batched_tokens"):
        profile.kv_cache_bytes  # noqa: B018


def test_a_share_that_other_processes_hold_is_refused_at_start() -> None:
    check_free(0.5, free=41 * GIB, total=80 * GIB)
    with pytest.raises(ValueError, match="lower gpu_memory_utilization"):
        check_free(0.5, free=39 * GIB, total=80 * GIB)


# ---- the engine -------------------------------------------------------------------------------------

def test_a_reported_device_sizes_the_pool_by_utilization(checkpoint: Path) -> None:
    memory = ReportedMemory(free=2 * GIB, total=2 * GIB, peak=100 * MIB)
    sized = engine(checkpoint, memory, gpu_memory_utilization=0.25)
    weights = sized.runner.weights_bytes()
    assert memory.profiled == [1]  # one forward pass of the largest step, after the weights loaded
    expected = (int(0.25 * 2 * GIB) - weights - 100 * MIB - MARGIN_BYTES) // block_bytes(sized)
    assert sized.num_blocks == expected
    assert sized.runner.kv_caches[0].shape[1] == expected
    assert sized.memory_profile is not None and sized.memory_profile.weights == weights > 0


def test_a_fuller_device_is_refused_before_loading(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="free"):
        engine(checkpoint, ReportedMemory(free=1 * GIB, total=2 * GIB, peak=0), gpu_memory_utilization=0.9)


def test_kv_cache_memory_gb_overrides_the_utilization(checkpoint: Path) -> None:
    memory = ReportedMemory(free=2 * GIB, total=2 * GIB, peak=100 * MIB)
    sized = engine(checkpoint, memory, kv_cache_memory_gb=0.01)
    assert memory.profiled == [] and sized.memory_profile is None
    assert sized.num_blocks == int(0.01 * GIB) // block_bytes(sized)


def test_an_engine_on_the_cpu_sizes_from_kv_cache_memory_gb(checkpoint: Path) -> None:
    fixed = engine(checkpoint, kv_cache_memory_gb=0.01)
    assert fixed.num_blocks == int(0.01 * GIB) // block_bytes(fixed)
    default = engine(checkpoint, cpu_kv_cache_memory_gb=0.02)
    assert default.num_blocks == int(0.02 * GIB) // block_bytes(default) and default.memory_profile is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_pool_fills_the_utilization(checkpoint: Path) -> None:
    """Half the GPU: after the largest step ran, what the engine allocated at its peak is within the
    margin (and a block per layer) of half the device."""
    from cluster.common.sampling_params import SamplingParams

    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    sized = LLMEngine(EngineConfig(model=fp32_model(checkpoint, device="cuda"),
                                   cache=CacheConfig(gpu_memory_utilization=0.5),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=256)))
    torch.cuda.reset_peak_memory_stats()
    sized.generate([[5] * 250], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    _, total = torch.cuda.mem_get_info()
    peak = torch.cuda.max_memory_allocated() - start
    assert 0.5 * total - MARGIN_BYTES - 2 * block_bytes(sized) - 64 * MIB <= peak <= 0.5 * total
