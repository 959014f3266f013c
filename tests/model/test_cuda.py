"""The engine on a CUDA device (the `gpu` marker: skipped without one; docs/kernels.md says how a lent
GPU runs these): greedy tokens equal transformers' on the same device, with the torch and
the Triton attention backends, and decode steps replayed as CUDA graphs equal eager ones."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PROMPTS = [[5, 17, 42, 99, 123, 7, 250, 31, 64, 12, 200, 3, 77], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3, [300, 2, 3]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def greedy(checkpoint: Path, backend: str) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=fp32_model(checkpoint, device="cuda"),
                                    cache=CacheConfig(block_size=16, num_blocks=64), attention_backend=backend))
    assert engine.runner.kv_caches[0].is_cuda
    engine.warm_up()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [output.token_ids for output in engine.generate(PROMPTS, params)]


def oracle(checkpoint: Path) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).cuda().eval()
    answers = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 min_new_tokens=MAX_TOKENS, pad_token_id=0)
        answers.append(out[0, len(prompt):].tolist())
    return answers


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_greedy_on_cuda_equals_transformers_on_cuda(checkpoint: Path, backend: str) -> None:
    assert greedy(checkpoint, backend) == oracle(checkpoint)


def test_cuda_graph_replays_equal_eager_steps(checkpoint: Path) -> None:
    """Warm-up captures every bucket up to max_num_seqs (8 here: 1, 2, 4, 8) while another thread
    allocates and copies on the device, as a KV transfer's landing does (the capture is thread-local);
    serving captures nothing more, and replays give the eager steps' tokens."""
    engine = LLMEngine(EngineConfig(model=fp32_model(checkpoint, device="cuda"),
                                    cache=CacheConfig(block_size=16, num_blocks=64), attention_backend="triton",
                                    scheduler=SchedulerConfig(max_num_seqs=8)))
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    stop = threading.Event()

    def transfer_like() -> None:
        while not stop.is_set():
            landing = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            landing.copy_(torch.ones(1 << 20, dtype=torch.uint8, pin_memory=True), non_blocking=True)
            torch.cuda.current_stream().synchronize()

    other = threading.Thread(target=transfer_like)
    other.start()
    try:
        engine.warm_up()
    finally:
        stop.set()
        other.join()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with_graphs = [output.token_ids for output in engine.generate(PROMPTS, params)]
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    graphs.enabled = False
    eager = [output.token_ids for output in engine.generate(PROMPTS, params)]
    assert with_graphs == eager


def test_a_landing_buffer_is_free_to_reuse_once_its_kv_is_imported(checkpoint: Path) -> None:
    """UCX writes a landing buffer's memory off the engine's stream. The import's copies, queued
    behind a long kernel, must be done when `write_blocks` returns: the buffer is then overwritten
    from another stream (the next transfer landing in reused memory) and the cache keeps what landed."""
    engine = LLMEngine(EngineConfig(model=fp32_model(checkpoint, device="cuda"),
                                    cache=CacheConfig(block_size=16, num_blocks=64)))
    runner = engine.runner
    shape = (2, len(runner.kv_caches), 2, *runner.kv_caches[0].shape[2:])
    landed = torch.randn(shape, device="cuda", dtype=runner.kv_dtype)
    expected = landed.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the import's copies may start
    runner.write_blocks([3, 7], landed)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        landed.fill_(0)  # the next transfer, on a stream of its own
    torch.cuda.synchronize()
    assert torch.equal(runner.read_blocks([3, 7]).to("cuda"), expected)
