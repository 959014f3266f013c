"""KV cache transfer between prefill and decode workers: the connector interface, a loopback
implementation for tests, and the UCX implementation (loaded lazily: `ucxx` is optional)."""
