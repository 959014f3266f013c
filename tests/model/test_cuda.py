"""The engine on a CUDA device (the `gpu` marker: skipped without one; docs/kernels.md says how a lent
GPU runs these): greedy tokens equal transformers' on the same device, with the torch and
the Triton attention backends, and decode steps replayed as CUDA graphs equal eager ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig
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
    engine = LLMEngine(EngineConfig(model=fp32_model(checkpoint, device="cuda"),
                                    cache=CacheConfig(block_size=16, num_blocks=64), attention_backend="triton"))
    assert engine.runner.decode_graphs is not None
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    with_graphs = [output.token_ids for output in engine.generate(PROMPTS, params)]
    assert engine.runner.decode_graphs.graphs, "no decode step was captured"
    engine.runner.decode_graphs.enabled = False
    eager = [output.token_ids for output in engine.generate(PROMPTS, params)]
    assert with_graphs == eager
