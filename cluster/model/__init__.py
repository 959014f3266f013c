"""The forward pass: the Llama model, the runner that batches a scheduler step onto it, the sampler,
CUDA graphs, and the attention backends over the paged KV cache."""
