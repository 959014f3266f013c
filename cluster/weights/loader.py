"""Weight loading: Hugging Face checkpoint directories (config.json + *.safetensors) and GGUF files.

Everything comes out under Hugging Face parameter names (`model.layers.0.self_attn.q_proj.weight`, ...)
so the model code has a single naming scheme to map, whatever the file format.

torch is imported only where tensors are made, so that `cluster.weights.tokenizer` (which raises
`ModelLoadError`) stays importable in a process without it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cluster.common.errors import ModelLoadError, missing_package
from cluster.weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch


def load_hf_config(model_dir: Path) -> dict[str, Any]:
    """Read `config.json` of a Hugging Face checkpoint directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(
            f"no config.json in {model_dir}: expected a Hugging Face checkpoint directory or a .gguf file"
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"invalid JSON in {path}: {error}") from error
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def rope_theta(config: dict[str, Any], default: float = 10000.0) -> float:
    """The RoPE base of a Hugging Face config.

    transformers 5 writes it as `rope_parameters.rope_theta`, older versions (and most checkpoints on the
    Hub) as a top-level `rope_theta`; both must be read.
    """
    parameters = config.get("rope_parameters") or {}
    if "rope_theta" in parameters:
        return float(parameters["rope_theta"])
    return float(config.get("rope_theta", default))


def iterate_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, tensor) over every *.safetensors file, one tensor at a time.

    One at a time so that a caller copying into its own buffers never holds two copies of the model.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, handle.get_tensor(name)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What an engine builds its model from: config.json's fields, the tokenizer, and the weights, made
    one tensor at a time as `weights()` is iterated (read from files, or generated on the device they
    load into: `cluster.weights.synthetic.random_checkpoint`)."""

    hf_config: dict[str, Any]
    tokenizer: Tokenizer
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    # Parameters whose weights arrive quantized (name -> GGUF quantization, or `cluster.model.scaled`'s int8
    # or fp8 qtype): the model keeps them so.
    quantized: dict[str, str] = field(default_factory=dict)


def load_checkpoint(model_dir: Path) -> Checkpoint:
    """A Hugging Face checkpoint directory: its config and tokenizer read here, its safetensors as they load."""
    return Checkpoint(load_hf_config(model_dir), Tokenizer.from_dir(model_dir),
                      functools.partial(iterate_safetensors, model_dir))


# --------------------------------------------------------------------------------------------------
# GGUF


@dataclass(frozen=True, slots=True)
class _GGUFArchitecture:
    """What differs between the GGUF architectures we read."""

    hf_architecture: str
    model_type: str
    # llama.cpp's converter permutes q/k rows of Llama models for its RoPE layout; Qwen2 is left as is.
    permutes_qk: bool


_ARCHITECTURES: dict[str, _GGUFArchitecture] = {
    "llama": _GGUFArchitecture("LlamaForCausalLM", "llama", permutes_qk=True),
    "qwen2": _GGUFArchitecture("Qwen2ForCausalLM", "qwen2", permutes_qk=False),
}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

_BLOCK_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(slots=True)
class GGUFTokenizerInfo:
    """The tokenizer as a GGUF file describes it (`tokenizer.*` metadata)."""

    model: str | None = None  # "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
    pre: str | None = None  # llama.cpp's pre-tokenizer name, e.g. "smollm"
    tokens: list[str] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    padding_token_id: int | None = None
    unknown_token_id: int | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    chat_template: str | None = None


@dataclass(slots=True)
class GGUFCheckpoint:
    """A GGUF model translated to Hugging Face terms: config, float32 tensors and tokenizer metadata."""

    hf_config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: GGUFTokenizerInfo
    architecture: str


def permutes_qk(architecture: str) -> bool:
    """Whether llama.cpp's converter permuted this GGUF architecture's q/k rows (see `unpermute_from_gguf`)."""
    return _ARCHITECTURES[architecture].permutes_qk


def hf_name_for_gguf_tensor(gguf_name: str) -> str:
    """Map a GGUF tensor name (`blk.3.attn_q.weight`) to its Hugging Face name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_TENSOR_PATTERN.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        if gguf_name == "rope_freqs.weight":
            raise ModelLoadError("GGUF tensor rope_freqs.weight (Llama 3 RoPE scaling) is not supported")
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}: not part of a Llama/Qwen2 model")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_BLOCK_TENSORS[kind]}.{suffix}"


def permute_for_gguf(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's `permute` (convert_hf_to_gguf.py) of q/k rows: per head, interleave the two rotary halves.

    Only the tests and GGUF writers need it; reading applies `unpermute_from_gguf`.
    """
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def unpermute_from_gguf(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of `permute_for_gguf`: back to Hugging Face's half-split rotary layout."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def read_gguf(path: Path, on_progress: Callable[[int, int], None] | None = None) -> GGUFCheckpoint:
    """Read and dequantize a GGUF model into float32 tensors under Hugging Face names.

    `on_progress(done, total)` is called after each tensor: dequantizing is the slow part.
    """
    try:
        import gguf
    except ModuleNotFoundError as error:  # optional: safetensors checkpoints load without it
        raise missing_package("gguf", f"loading the GGUF file {path}") from error

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as error:
        raise ModelLoadError(f"cannot read {path} as GGUF: {error}") from error
    metadata = _read_metadata(reader)
    architecture = _architecture_of(metadata, path)
    tensors = _read_tensors(reader, metadata, architecture, on_progress)
    hf_config = _hf_config_from_metadata(metadata, architecture, tensors)
    return GGUFCheckpoint(hf_config, tensors, _tokenizer_info(metadata), architecture)


def _read_metadata(reader: Any) -> dict[str, Any]:
    """All key/value fields as plain Python values (strings, numbers, lists)."""
    metadata: dict[str, Any] = {}
    for key, reader_field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # header fields (version, counts), not model metadata
        value = reader_field.contents()
        metadata[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return metadata


def _architecture_of(metadata: dict[str, Any], path: Path) -> str:
    architecture = metadata.get("general.architecture")
    if architecture not in _ARCHITECTURES:
        supported = ", ".join(sorted(_ARCHITECTURES))
        raise ModelLoadError(
            f"unsupported GGUF architecture {architecture!r} in {path}; supported: {supported}"
        )
    return str(architecture)


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return metadata[key]


def _read_tensors(
    reader: Any,
    metadata: dict[str, Any],
    architecture: str,
    on_progress: Callable[[int, int], None] | None,
) -> dict[str, torch.Tensor]:
    import torch

    num_heads = int(_required(metadata, f"{architecture}.attention.head_count"))
    num_kv_heads = int(metadata.get(f"{architecture}.attention.head_count_kv", num_heads))
    permutes_qk = _ARCHITECTURES[architecture].permutes_qk
    tensors: dict[str, torch.Tensor] = {}
    for index, reader_tensor in enumerate(reader.tensors):
        name = hf_name_for_gguf_tensor(reader_tensor.name)
        values = dequantize_tensor(reader_tensor)
        if permutes_qk and ".q_proj." in name:
            values = unpermute_from_gguf(values, num_heads)
        elif permutes_qk and ".k_proj." in name:
            values = unpermute_from_gguf(values, num_kv_heads)
        # A fresh, writable, contiguous copy: the reader's arrays are views of a read-only memory map.
        tensors[name] = torch.from_numpy(np.array(values, dtype=np.float32, order="C"))
        if on_progress is not None:
            on_progress(index + 1, len(reader.tensors))
    return tensors


def dequantize_tensor(reader_tensor: Any) -> np.ndarray:
    """Dequantize to float32 in Hugging Face shape; GGUF lists dimensions innermost first."""
    from gguf.quants import dequantize

    hf_shape = tuple(int(size) for size in reversed(reader_tensor.shape))
    try:
        values = dequantize(reader_tensor.data, reader_tensor.tensor_type)
    except NotImplementedError as error:
        raise ModelLoadError(
            f"GGUF tensor {reader_tensor.name}: quantization {reader_tensor.tensor_type.name} "
            "is not supported"
        ) from error
    return values.reshape(hf_shape)


def _hf_config_from_metadata(
    metadata: dict[str, Any], architecture: str, tensors: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """A Hugging Face config.json for the GGUF model (the keys LlamaConfig/Qwen2Config read)."""
    prefix = f"{architecture}."
    hidden_size = int(_required(metadata, prefix + "embedding_length"))
    num_heads = int(_required(metadata, prefix + "attention.head_count"))
    head_dim = int(metadata.get(prefix + "attention.key_length", hidden_size // num_heads))
    rotary_dim = int(metadata.get(prefix + "rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ModelLoadError(f"partial rotary embeddings ({rotary_dim} of {head_dim} dims) are not supported")
    _reject_rope_scaling(metadata, prefix)
    if "model.embed_tokens.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    theta = _float32_value(metadata.get(prefix + "rope.freq_base", 10000.0))
    spec = _ARCHITECTURES[architecture]
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": int(_required(metadata, prefix + "feed_forward_length")),
        "num_hidden_layers": int(_required(metadata, prefix + "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(metadata.get(prefix + "attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(metadata.get(prefix + "attention.layer_norm_rms_epsilon", 1e-6)),
        # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": int(metadata.get(prefix + "context_length", 2048)),
        "vocab_size": _vocab_size(metadata, tensors),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if spec.model_type == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
        config["mlp_bias"] = False
    return config


def _float32_value(value: float) -> float:
    """GGUF stores float32: write 1e-05, not 9.999999747378752e-06 (its shortest float32 spelling)."""
    return float(str(np.float32(value)))


def _vocab_size(metadata: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """The token list's length; it must agree with the embedding, or no Hugging Face loader accepts it."""
    embedding_rows = int(tensors["model.embed_tokens.weight"].shape[0])
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens and len(tokens) != embedding_rows:
        raise ModelLoadError(
            f"GGUF token list has {len(tokens)} entries but token_embd.weight has {embedding_rows} rows"
        )
    return embedding_rows


def _reject_rope_scaling(metadata: dict[str, Any], prefix: str) -> None:
    scaling = metadata.get(prefix + "rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF RoPE scaling {scaling!r} is not supported")


def _tokenizer_info(metadata: dict[str, Any]) -> GGUFTokenizerInfo:
    def optional_int(key: str) -> int | None:
        value = metadata.get(key)
        return None if value is None else int(value)

    def optional_bool(key: str) -> bool | None:
        value = metadata.get(key)
        return None if value is None else bool(value)

    return GGUFTokenizerInfo(
        model=metadata.get("tokenizer.ggml.model"),
        pre=metadata.get("tokenizer.ggml.pre"),
        tokens=list(metadata.get("tokenizer.ggml.tokens") or []),
        bos_token_id=optional_int("tokenizer.ggml.bos_token_id"),
        eos_token_id=optional_int("tokenizer.ggml.eos_token_id"),
        padding_token_id=optional_int("tokenizer.ggml.padding_token_id"),
        unknown_token_id=optional_int("tokenizer.ggml.unknown_token_id"),
        add_bos_token=optional_bool("tokenizer.ggml.add_bos_token"),
        add_eos_token=optional_bool("tokenizer.ggml.add_eos_token"),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
