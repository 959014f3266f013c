"""The torch attention backend over the paged KV cache (the CPU path): torch ops only."""

from __future__ import annotations

import torch

from cluster.model.attention.backend import AttentionMetadata
from kernels import reference, torch_decode


class TorchAttentionBackend:
    """Batched decodes (grouped matmuls, `kernels.torch_decode`), prefills one sequence at a time (the reference)."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        reference.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        decodes = metadata.num_decodes
        if decodes == len(metadata.seq_lens_list):
            return torch_decode.paged_decode_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                                    metadata.max_seq_len, scale)
        out = torch.empty_like(query)
        if decodes:
            out[:decodes] = torch_decode.paged_decode_attention(
                query[:decodes], kv_cache, metadata.block_tables[:decodes], metadata.seq_lens[:decodes],
                max(metadata.seq_lens_list[:decodes]), scale)
        starts = [start - decodes for start in metadata.query_start_list[decodes:]]
        out[decodes:] = reference.paged_prefill_attention(
            query[decodes:], kv_cache, metadata.block_tables[decodes:], starts, metadata.seq_lens_list[decodes:], scale)
        return out

