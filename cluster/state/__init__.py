"""What routers, workers and gateways share: the prefix-block index, the worker registry and the rate
limits' buckets. The interface, the in-process implementation, Redis, and the resilient wrapper."""
