"""Which torch device an engine runs on, from its configuration (`ModelConfig.device`)."""

from __future__ import annotations

import torch


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
