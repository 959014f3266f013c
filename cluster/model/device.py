"""Which torch device an engine runs on, from its configuration (`ModelConfig.device`)."""

from __future__ import annotations

import warnings

import torch

# CUDA 13's minimum Linux driver (NVIDIA's release notes): what torch 2.13's default wheels need.
MIN_DRIVER_CUDA_13 = "580.65.06"


def resolve_device(spec: str) -> torch.device:
    """"auto" is the first CUDA device where torch sees one, else the CPU. A CUDA device that is not
    there is refused with what to change, not found out at the first step."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ValueError(f"device {spec!r}: torch {torch.__version__} ({build}) sees no CUDA device here; "
                             "use device cpu, or auto to take a GPU only where there is one")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def cuda_unusable_reason() -> str | None:
    """Why torch in this process cannot use a GPU (None where it can): a CPU-only build, or a CUDA build
    that finds none (most often an NVIDIA driver older than its CUDA needs; torch's own warning says)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            return None
    if not torch.version.cuda:
        return f"torch {torch.__version__} is a CPU-only build (make install TORCH=cuda installs the CUDA one)"
    said = " ".join(str(warning.message) for warning in caught)
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU: "
            f"{said or 'no device, or a driver too old'} (CUDA 13 needs driver >= {MIN_DRIVER_CUDA_13})")


def resolve_dtype(spec: str, device: torch.device) -> tuple[str, str]:
    """The weights' and KV cache's dtype, and why: `spec` unless it is "auto", which picks by the hardware.

    On CUDA bf16 where the GPU has it (Ampere and later), else fp16. On a CPU bf16 only where
    matmuls run natively in it (AMX or AVX512-BF16): there the linear layers run several times faster
    in bf16 than in fp32, while elsewhere bf16 is emulated and several times slower
    (docs/performance.md).
    """
    if spec != "auto":
        return spec, "asked for"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: the GPU has bf16"
        return "float16", "auto: the GPU has no bf16"
    return cpu_dtype(cpu_capabilities())


def resolve_kv_cache_dtype(spec: str, dtype: str) -> str:
    """The KV cache's dtype (a torch dtype's name) for `CacheConfig.kv_cache_dtype` under weights in `dtype`."""
    return {"auto": dtype, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}[spec]


def cpu_dtype(capabilities: dict[str, object]) -> tuple[str, str]:
    """bf16 where the CPU multiplies in it natively, fp32 elsewhere; and why."""
    native = [name for name in ("amx_bf16", "avx512_bf16") if capabilities.get(name)]
    if native:
        return "bfloat16", f"auto: the CPU has {' and '.join(n.upper() for n in native)}"
    return "float32", "auto: the CPU has no native bf16 matmuls (AMX, AVX512-BF16)"


def cpu_capabilities() -> dict[str, object]:
    """The instruction sets torch found on this CPU (its own kernel dispatch uses the same probe)."""
    return dict(torch.cpu.get_capabilities())
