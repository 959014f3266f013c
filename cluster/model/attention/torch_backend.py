"""The torch attention backend over the paged KV cache (the CPU path): torch ops only."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cluster.model.attention.backend import AttentionMetadata
from kernels import reference, torch_decode


class TorchAttentionBackend:
    """Batched decodes (SDPA in fp32, grouped matmuls in bf16: `_decode_attention`), prefills one sequence
    at a time (the reference)."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        reference.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        decode = _decode_attention(kv_cache.dtype)
        decodes = metadata.num_decodes
        if decodes == len(metadata.seq_lens_list):
            return decode(query, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.max_seq_len, scale)
        out = torch.empty_like(query)
        if decodes:
            out[:decodes] = decode(
                query[:decodes], kv_cache, metadata.block_tables[:decodes], metadata.seq_lens[:decodes],
                max(metadata.seq_lens_list[:decodes]), scale)
        starts = [start - decodes for start in metadata.query_start_list[decodes:]]
        out[decodes:] = reference.paged_prefill_attention(
            query[decodes:], kv_cache, metadata.block_tables[decodes:], starts, metadata.seq_lens_list[decodes:], scale)
        return out


def _decode_attention(dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    """SDPA in fp32; grouped matmuls in bf16 and fp16, where SDPA's masked GQA path on CPUs is slow.
    A 64-row decode step of the default model, 1 thread, the AVX512-BF16 EPYC: attention 81 ms with
    SDPA and 113 ms with the matmuls in fp32; 305 ms and 82 ms in bf16 (benchmarks.engine step-vs-linear)."""
    return reference.paged_decode_attention if dtype == torch.float32 else torch_decode.paged_decode_attention
