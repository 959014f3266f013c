"""The gRPC API server (the client SDK is `cluster.client`, the stubs `cluster.grpc_stubs`)."""
