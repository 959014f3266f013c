"""Deterministic mode (`ModelConfig.deterministic`): a request's greedy tokens the same alone and among 31
others, with its prompt in chunks or whole, and resumed after any of its tokens (the prompt plus the tokens
generated, prefilled again, as a worker does after another died): in bf16 and in fp32. Without it, those
differ (the control): prefill attention sums in another order than decode's, and fp32 matmuls by the
number of rows."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.quantize import quantize_checkpoint
from cluster.weights.synthetic import build_tiny_llama_checkpoint

GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=1)
PROMPT = [5 + (7 * i) % 250 for i in range(40)]
OTHERS = [[3 + (11 * i + 13 * j) % 290 for j in range(8 + 3 * i % 37)] for i in range(31)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"), num_layers=4, hidden=128, heads=4,
                                       kv_heads=2, seed=3)


def engine(checkpoint: Path, dtype: str, deterministic: bool, budget: int = 2048) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ModelConfig(model=str(checkpoint), dtype=dtype, deterministic=deterministic),
                                  cache=CacheConfig(block_size=4, num_blocks=2048),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def run(llm: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[tuple[int, float]]]:
    """Each prompt's (token, log-probability) pairs, all prompts in the engine at once."""
    ids = [llm.add_request(prompt, params).request_id for prompt in prompts]
    found: dict[str, list[tuple[int, float]]] = {request_id: [] for request_id in ids}
    while llm.has_unfinished_requests():
        for output in llm.step():
            found[output.request_id] += [(entry.token_id, entry.logprob) for entry in output.new_logprobs]
    return [found[request_id] for request_id in ids]


def disagreements(checkpoint: Path, dtype: str, deterministic: bool) -> dict[str, int]:
    """How many of PROMPT's greedy tokens, or their log-probabilities to the last bit, differ from its run
    alone, per way of running it."""
    alone = run(engine(checkpoint, dtype, deterministic), [PROMPT], GREEDY)[0]
    batched = run(engine(checkpoint, dtype, deterministic), [*OTHERS[:16], PROMPT, *OTHERS[16:]], GREEDY)[16]
    chunked = run(engine(checkpoint, dtype, deterministic, budget=16), [PROMPT], GREEDY)[0]
    resumer = engine(checkpoint, dtype, deterministic)
    resumed = []
    for cut in (1, 7, 20, 33):  # the prompt plus the first `cut` tokens, prefilled again
        params = replace(GREEDY, max_tokens=len(alone) - cut, seed_offset=cut)
        tokens = [token for token, _ in alone[:cut]]
        resumed.append(alone[:cut] + run(resumer, [PROMPT + tokens], params)[0])
    return {"batch of 32": sum(a != b for a, b in zip(alone, batched, strict=True)),
            "chunked": sum(a != b for a, b in zip(alone, chunked, strict=True)),
            "resumed": sum(a != b for again in resumed for a, b in zip(alone, again, strict=True))}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_deterministic_mode_gives_one_answer_however_the_request_runs(checkpoint: Path, dtype: str) -> None:
    assert disagreements(checkpoint, dtype, deterministic=True) == {"batch of 32": 0, "chunked": 0, "resumed": 0}


def test_deterministic_mode_covers_8_bit_checkpoints(checkpoint: Path, tmp_path: Path) -> None:
    """int8 rows, whose scale multiplies after the sums outside this mode, widened and tiled in it."""
    for scheme in ("int8-channel",):
        quantized = quantize_checkpoint(checkpoint, tmp_path / scheme, scheme, block=(32, 64))
        assert disagreements(quantized, "bfloat16", deterministic=True) == \
            {"batch of 32": 0, "chunked": 0, "resumed": 0}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_without_it_how_a_request_runs_changes_its_numbers(checkpoint: Path, dtype: str) -> None:
    """The control: the same comparisons find differences in the default mode (in the log-probabilities
    at least; whether they flip a greedy token of this tiny model is luck)."""
    assert any(disagreements(checkpoint, dtype, deterministic=False).values())
