"""The Triton attention backend: the same contract as `cluster.model.attention.torch_backend.TorchAttentionBackend`.

A step is at most three launches per layer: the cache write for every new token, the decode kernel
for the first `num_decodes` sequences, and the prefill kernel for all the others together. Both
attention kernels write straight into their rows of one output tensor.
"""

from __future__ import annotations

import torch

from cluster.model.attention.backend import AttentionMetadata
from pdserve_kernels import triton_cache, triton_decode, triton_prefill
from pdserve_kernels.reference import CAUSAL, AttentionOptions


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        """`num_splits` fixes the decode kernel's split-K factor (default: chosen per step)."""
        if not torch.cuda.is_available() and not triton_cache.interpreter_active():
            raise ValueError("the triton attention backend needs a CUDA device; on CPUs set TRITON_INTERPRET=1 "
                             "(before triton is imported) to run its kernels in Triton's slow interpreter, "
                             "or use attention_backend='torch'")
        self.num_splits = num_splits

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,  # noqa: PLR0913
                metadata: AttentionMetadata, scale: float, options: AttentionOptions = CAUSAL) -> torch.Tensor:
        triton_cache.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        decodes, num_seqs = metadata.num_decodes, len(metadata.seq_lens_list)
        if decodes:
            max_seq_len = metadata.max_seq_len if decodes == num_seqs else max(metadata.seq_lens_list[:decodes])
            triton_decode.paged_decode_attention(
                query[:decodes], kv_cache, metadata.block_tables[:decodes], metadata.seq_lens[:decodes],
                max_seq_len, scale, options, out=out[:decodes], num_splits=self.num_splits)
        if decodes < num_seqs:
            starts = metadata.query_start_list
            max_query_len = max(b - a for a, b in zip(starts[decodes:-1], starts[decodes + 1:], strict=True))
            # The query starts index rows of the whole `query`: the prefills attend in place after the decodes.
            triton_prefill.paged_prefill_attention(
                query, kv_cache, metadata.block_tables[decodes:], metadata.seq_lens[decodes:],
                metadata.query_start_loc[decodes:], max_query_len, scale, options, out=out)
        return out
