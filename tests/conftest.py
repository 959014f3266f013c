"""Session-wide fixtures: the default model and transformers' greedy answers, computed once."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.ray_cluster.config import ClusterConfig
from tests.deploy.test_multinode import Processes
from tests.helpers import fp32_model, on_cpu
from tests.state.conftest import dedicated_redis, redis_server  # noqa: F401  (real redis-servers, for every package)
from tests.triton_mode import choose_interpreter

TRITON_INTERPRETED = pytest.StashKey[bool]()
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
]
MAX_TOKENS = 40


def pytest_configure(config: pytest.Config) -> None:
    # Before any test module is imported: Triton reads the choice when it decorates the kernels.
    config.stash[TRITON_INTERPRETED] = choose_interpreter()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests never run interpreted kernels: where the environment forced the interpreter, they skip."""
    if not config.stash[TRITON_INTERPRETED]:
        return
    skip = pytest.mark.skip(reason="TRITON_INTERPRET=1 in this process: gpu tests need compiled kernels")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clusters_on_cpu(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cluster a test starts in this process runs its engines on the CPU (device auto made cpu),
    unless the test is `gpu`-marked: on a GPU host the tests' pools of 3-4 workers would ask Ray for
    more GPUs than it has. Serving processes the tests start pass --device cpu themselves."""
    if request.node.get_closest_marker("gpu"):
        return
    from cluster.ray_cluster import launcher

    build = launcher.Cluster.__init__

    def on_cpu_init(self: launcher.Cluster, config: ClusterConfig) -> None:
        build(self, on_cpu(config))

    monkeypatch.setattr(launcher.Cluster, "__init__", on_cpu_init)


@pytest.fixture(scope="session")
def default_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=fp32_model(), cache=CacheConfig(kv_cache_memory_gb=0.5)))


@pytest.fixture(scope="session")
def default_prompts(default_engine: LLMEngine) -> list[list[int]]:
    return [default_engine.chat_prompt([{"role": "user", "content": question}]) for question in QUESTIONS]


@pytest.fixture(scope="session")
def transformers_greedy(default_engine: LLMEngine, default_prompts: list[list[int]]) -> list[list[int]]:
    """The oracle: transformers' greedy `generate` on the same weights, each prompt alone."""
    import torch
    import transformers

    oracle = transformers.AutoModelForCausalLM.from_pretrained(default_engine.model_dir, dtype=torch.float32).eval()
    outputs = []
    for prompt in default_prompts:
        with torch.no_grad():
            generated = oracle.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                        eos_token_id=list(default_engine.tokenizer.eos_token_ids), pad_token_id=0)
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


# Processes of their own (Ray nodes, gateways): tests/deploy and tests/ray_cluster/test_two_hosts.py.
@pytest.fixture
def processes() -> Iterator[Processes]:
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-mn-logs-"))
    started = Processes(log_dir)
    try:
        yield started
    finally:
        started.stop_all()
        shutil.rmtree(log_dir, ignore_errors=True)


@pytest.fixture
def ray_temp_dir() -> Iterator[Path]:
    # Short: Ray's unix sockets live under it and their paths must stay under 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="pdmn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
