"""The Triton kernels run here in Triton's interpreter, on CPU tensors (also on GPU machines).

Triton decides when it decorates a kernel whether the kernel is interpreted, so the variable is set
before any test module imports `pdserve_kernels.triton_*`.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"
