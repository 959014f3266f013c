"""Attention over the paged KV cache: the backend interface, the torch backend (CPUs), the Triton
adaptor (CUDA) and the registry that picks one. The kernels themselves live in `kernels/pdserve_kernels/`
(import name `pdserve_kernels`)."""
