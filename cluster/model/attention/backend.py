"""The attention backend interface over the paged KV cache (the one dispatch point is `registry`).

The model runner builds one `AttentionMetadata` per step; every layer's attention calls
`backend.forward`, which first writes the step's new keys and values into the cache (all of them,
before any read: a block shared through the prefix cache in the same step is therefore complete),
then attends. Sequences are ordered decodes first: the first `num_decodes` have one query token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve_kernels.reference import CAUSAL, AttentionOptions


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

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,  # noqa: PLR0913
                metadata: AttentionMetadata, scale: float, options: AttentionOptions = CAUSAL) -> torch.Tensor:
        """query [tokens, heads, head_dim], key/value [tokens, kv_heads, head_dim] -> [tokens, heads, head_dim].
        `options`: the layer's sliding window and soft cap on its scores (`pdserve_kernels.reference`)."""
        ...
