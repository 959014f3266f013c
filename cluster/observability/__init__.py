"""Prometheus metrics (with vLLM's names) and the JSON log format."""
