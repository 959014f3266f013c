"""Whether this pytest process runs Triton's kernels in Triton's interpreter.

Triton reads TRITON_INTERPRET when it decorates a kernel, so the choice holds for the whole process
and is made once, in tests/conftest.py, before any test module imports `pdserve_kernels.triton_*`.
Interpreted kernels take CPU tensors (CI's machines have no GPU); on a machine with a usable CUDA
device they must stay compiled, or the `gpu` tests would run interpreted kernels and CUDA graph
capture would fail.
"""

from __future__ import annotations

import os

INTERPRET = "TRITON_INTERPRET"


def interpret_triton(cuda_usable: bool, asked: str | None) -> bool:
    """`asked` (the environment's TRITON_INTERPRET) where set, else interpret only without CUDA."""
    if asked is not None:
        return asked not in ("", "0")
    return not cuda_usable


def choose_interpreter() -> bool:
    """Decide for this process (TRITON_INTERPRET=1 where it interprets); True where kernels are interpreted."""
    from cluster.model.device import cuda_unusable_reason

    interpret = interpret_triton(cuda_unusable_reason() is None, os.environ.get(INTERPRET))
    if interpret:
        os.environ[INTERPRET] = "1"
    return interpret


def interpreting() -> bool:
    """Whether this process interprets Triton's kernels (after `choose_interpreter`)."""
    return interpret_triton(True, os.environ.get(INTERPRET))
