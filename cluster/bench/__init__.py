"""The benchmark and soak clients: offline engine runs, and serving runs that drive a server from
outside over HTTP or gRPC (workloads, metrics, reports)."""
