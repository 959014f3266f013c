"""Benchmarks of the engine; run them with `python -m benchmarks.engine --help`."""
