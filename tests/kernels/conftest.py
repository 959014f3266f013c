"""The Triton kernel tests run their kernels on CPU tensors, in Triton's interpreter. Whether this
process interprets is decided once for the whole session, by tests/conftest.py (`tests.triton_mode`):
only where no CUDA device is usable. On a GPU machine the tests that need the interpreter skip."""
