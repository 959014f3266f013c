"""The engine core: requests, the block pool, the KV cache manager, the scheduler and the engine loop
that drives them and the model runner. No Ray, HTTP, gRPC, Redis, UCX or Triton here."""
