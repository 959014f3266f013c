"""The front doors: the `Service` interface and its two implementations (Ray cluster, local engine),
the OpenAI-compatible HTTP gateway (`http/`), the gRPC server (`grpc/`), rate limits, and the serving
process that runs them all. The doors themselves load neither torch nor Ray."""
