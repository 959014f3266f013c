"""The one place that picks an attention backend by name (Triton loads only when asked for)."""

from __future__ import annotations

import torch

from cluster.model.attention.backend import AttentionBackend
from cluster.model.attention.torch_backend import TorchAttentionBackend


def backend_name(name: str, device: torch.device) -> str:
    """"auto" means Triton on CUDA devices and torch elsewhere."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def get_attention_backend(name: str, device: torch.device, deterministic: bool = False) -> AttentionBackend:
    """By `backend_name`. Triton loads only when asked for. `deterministic`: the torch backend with every
    token through the decode kernel (`cluster.model.batch_invariant`), on CPUs."""
    name = backend_name(name, device)
    if deterministic:
        if name != "torch" or device.type != "cpu":
            raise ValueError(f"deterministic mode runs the torch attention backend on CPUs; not {name} on "
                             f"{device.type} yet")
        from cluster.model.attention.deterministic_backend import DeterministicTorchBackend

        return DeterministicTorchBackend()
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        try:
            from cluster.model.attention.triton_backend import TritonAttentionBackend
        except ImportError as error:
            raise ValueError(f"the triton attention backend is not available here: {error}") from error
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}: use 'auto', 'torch' or 'triton'")

