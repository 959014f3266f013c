"""Matmuls over GGUF-quantized weights kept packed (`cpu_quant.c`), called through ctypes: what a
decode step of a quantized model spends its time on, reading 5 bits per 4-bit weight instead of 16.

`available()` is False where no compiler works; callers then widen the weights with torch
(`cluster.model.quantized.dequantize`) and use torch's matmul.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve_kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_quant.c")
QTYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q5_0": 4, "Q5_1": 5, "Q6_K": 6, "Q5_K": 7}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def library(march: str = "native") -> ctypes.CDLL | None:
    lib = cpu_build.load(SOURCE, march)
    if lib is not None:
        lib.quant_matmul.argtypes = (_P, _I64, _I64, _P, _I64, _INT, _P, _INT)
        lib.quant_matmul.restype = _INT
        lib.quant_widen.argtypes = (_P, _I64, _I64, _INT, _P, _INT, _INT)
        lib.quant_widen.restype = _INT
    return lib


def available(march: str = "native") -> bool:
    return library(march) is not None


def matmul(x: torch.Tensor, packed: torch.Tensor, qtype: str, num_threads: int | None = None) -> torch.Tensor:
    """x [rows, k] (fp32, contiguous) times the packed weight [n, k / 32 * block bytes] (uint8)
    transposed: [rows, n] in fp32."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU quantized matmul is not available here: check `available()` first")
    if x.dtype != torch.float32 or not x.is_contiguous() or packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError("quant_matmul takes contiguous fp32 activations and contiguous uint8 weights")
    rows, k = x.shape
    out = torch.empty(rows, packed.shape[0], dtype=torch.float32)
    status = lib.quant_matmul(x.data_ptr(), rows, k, packed.data_ptr(), packed.shape[0], QTYPES[qtype],
                              out.data_ptr(), num_threads or torch.get_num_threads())
    if status != 0:
        raise ValueError(f"quant_matmul refused {qtype} weights of width {k} (a multiple of its block is needed)")
    return out


def widen(packed: torch.Tensor, qtype: str, columns: int, dtype: torch.dtype,
          num_threads: int | None = None) -> torch.Tensor:
    """The packed rows [n, row bytes] widened to [n, columns] in `dtype` (fp32 or bf16)."""
    lib = library()
    if lib is None or dtype not in (torch.float32, torch.bfloat16) or not packed.is_contiguous():
        raise ValueError("quant_widen takes contiguous uint8 rows into fp32 or bf16, where the kernel builds")
    out = torch.empty(packed.shape[0], columns, dtype=dtype)
    status = lib.quant_widen(packed.data_ptr(), packed.shape[0], columns, QTYPES[qtype], out.data_ptr(),
                             int(dtype == torch.bfloat16), num_threads or torch.get_num_threads())
    if status != 0:
        raise ValueError(f"quant_widen refused {qtype} rows of width {columns}")
    return out
