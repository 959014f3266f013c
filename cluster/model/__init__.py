"""The forward pass: the decoders by architecture (`registry`, `models/`), the runner that batches a
scheduler step onto one, the sampler, CUDA graphs, and the attention backends over the paged KV cache."""
