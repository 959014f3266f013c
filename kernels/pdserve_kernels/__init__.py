"""Paged-attention and KV cache kernels: torch references (the CPU path and the test oracle) and,
beside them, Triton versions for CUDA devices."""
