"""Bad configurations and requests get clear errors, never tracebacks or hangs."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import main
from cluster.common.errors import ModelLoadError, QueueFullError
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.helpers import fp32_model, until_idle


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path = build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))
    return LLMEngine(EngineConfig(model=fp32_model(path, max_model_len=64),
                                  cache=CacheConfig(block_size=4, num_blocks=32),
                                  scheduler=SchedulerConfig(max_waiting_requests=2)))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (lambda: SchedulerConfig(max_num_seqs=-1), "max_num_seqs must be >= 1"),
    (lambda: SchedulerConfig(preemption_mode="drop"), "preemption_mode must be"),  # type: ignore[arg-type]
    (lambda: CacheConfig(block_size=12), "block_size must be a positive power of two"),
    (lambda: CacheConfig(num_blocks=-3), "num_blocks must be >= 0"),
    (lambda: CacheConfig(kv_cache_dtype="int8"), "kv_cache_dtype must be one of"),
    (lambda: ModelConfig(dtype="int4"), "dtype must be one of"),
    (lambda: ModelConfig(max_model_len=-1), "max_model_len must be >= 0"),
    (lambda: EngineConfig(attention_backend="cuda"), "attention_backend must be"),
    (lambda: SamplingParams(max_tokens=0), "max_tokens must be at least 1"),
    (lambda: SamplingParams(temperature=-1), "temperature must be >= 0"),
    (lambda: SamplingParams(top_p=0), "top_p must be in"),
    (lambda: SamplingParams(min_tokens=5, max_tokens=2), "min_tokens must be in"),
    (lambda: SamplingParams(seed=2**64), "seed must fit in 64 bits"),
    (lambda: SamplingParams(logprobs=100), "logprobs must be in"),
])
def test_invalid_settings_say_what_to_change(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_unknown_model_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        LLMEngine(EngineConfig(model=fp32_model(tmp_path / "nowhere")))


def test_directory_without_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        LLMEngine(EngineConfig(model=fp32_model(tmp_path)))


def test_context_longer_than_the_model_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLMEngine(EngineConfig(model=fp32_model(engine.model_dir, max_model_len=100_000)))


@pytest.mark.parametrize("window", [None, 32, 512, 4096], ids=["no-window", "window-32", "window-the-context",
                                                                 "window-past-it"])
def test_a_sliding_window_serves_the_models_whole_context(tmp_path: Path, window: int | None) -> None:
    """A Mistral whose layers slide a window narrower than its context is served that whole context (the
    attention slides the window): a prompt past the window generates."""
    path = build_tiny_llama_checkpoint(tmp_path, architecture="mistral", sliding_window=window)
    engine = LLMEngine(EngineConfig(model=fp32_model(path), cache=CacheConfig(block_size=4, num_blocks=256)))
    assert engine.arch.layer_windows == (() if window is None else (window, window))
    assert engine.max_model_len == 512
    request = engine.add_request(list(range(3, 83)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for _ in until_idle(engine):
        engine.step()
    assert len(request.output_token_ids) == 4


def test_prompt_longer_than_context_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="context is 64 tokens"):
        engine.add_request(list(range(3, 70)))
    assert not engine.has_unfinished_requests()


def test_empty_and_out_of_vocabulary_prompts_are_refused(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.add_request([5, 10_000_000])


def test_full_queue_rejects_then_recovers(engine: LLMEngine) -> None:
    first = engine.add_request([5, 6, 7])
    engine.add_request([8, 9])
    with pytest.raises(QueueFullError):
        engine.add_request([10])
    assert engine.abort(first.request_id)  # an abort frees a place in the queue at once
    for _ in until_idle(engine):
        engine.step()
    engine.add_request([10])  # room again
    for _ in until_idle(engine):
        engine.step()


def test_cli_reports_errors_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "hello", "--model", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("pdserve: error:") and "Traceback" not in err
    assert main(["generate", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens must be at least 1" in capsys.readouterr().err


def test_min_tokens_past_the_context_stops_at_its_end(engine: LLMEngine) -> None:
    """The context is full whatever `min_tokens` asks: a length finish, not a request that grows past
    its context and then waits for ever."""
    params = SamplingParams(temperature=0, min_tokens=60, max_tokens=60, ignore_eos=True)
    output = engine.generate([list(range(10, 30))], params)[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 64 - 20
    assert not engine.has_unfinished_requests()
