"""The attention backend interface over the paged KV cache, and its one dispatch point.

The model runner builds one `AttentionMetadata` per step; every layer's attention calls
`backend.forward`, which first writes the step's new keys and values into the cache (all of them,
before any read: a block shared through the prefix cache in the same step is therefore complete),
then attends. Sequences are ordered decodes first: the first `num_decodes` have one query token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import reference


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64: flat cache slot of each new token
    block_tables: torch.Tensor  # [sequences, max_blocks] int64, padded with 0
    seq_lens: torch.Tensor  # [sequences] int32: cached + new tokens
    query_start_loc: torch.Tensor  # [sequences + 1] int32: cumulative query lengths
    num_decodes: int
    max_seq_len: int
    # The same numbers as Python lists, for backends that loop over sequences on the host.
    seq_lens_list: list[int]
    query_start_list: list[int]


class AttentionBackend(Protocol):
    name: str

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [tokens, heads, head_dim], key/value [tokens, kv_heads, head_dim] -> [tokens, heads, head_dim]."""
        ...


class TorchAttentionBackend:
    """The reference backend: batched decodes, prefills one sequence at a time."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        reference.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        decodes = metadata.num_decodes
        if decodes == len(metadata.seq_lens_list):
            return reference.paged_decode_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens,
                                                    metadata.max_seq_len, scale)
        out = torch.empty_like(query)
        if decodes:
            out[:decodes] = reference.paged_decode_attention(
                query[:decodes], kv_cache, metadata.block_tables[:decodes], metadata.seq_lens[:decodes],
                max(metadata.seq_lens_list[:decodes]), scale)
        starts = [start - decodes for start in metadata.query_start_list[decodes:]]
        out[decodes:] = reference.paged_prefill_attention(
            query[decodes:], kv_cache, metadata.block_tables[decodes:], starts, metadata.seq_lens_list[decodes:], scale)
        return out


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """"auto" means Triton on CUDA devices and torch elsewhere. Triton loads only when asked for."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        try:
            from kernels.triton_backend import TritonAttentionBackend
        except ImportError as error:
            raise ValueError(f"the triton attention backend is not available here: {error}") from error
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}: use 'auto', 'torch' or 'triton'")
