"""The attention of deterministic mode (`cluster.model.batch_invariant` says why): the torch backend with
every query token through the decode kernel."""

from __future__ import annotations

import torch

from cluster.model import elementwise
from cluster.model.attention.backend import AttentionMetadata
from cluster.model.attention.torch_backend import TorchAttentionBackend, decode_attention
from pdserve_kernels import cpu_decode
from pdserve_kernels.reference import CAUSAL, AttentionOptions


class DeterministicTorchBackend(TorchAttentionBackend):
    """Every query token, prompt tokens included, attends through the decode kernel over the cache up
    to its own position: one token's result whether it was prefilled, decoded, chunked or recomputed.
    The C decode kernel computes each token on one thread in an order set by its context alone; without
    it, the torch decode ops run one token at a time for the same reason."""

    name = "torch-deterministic"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,  # noqa: PLR0913
                metadata: AttentionMetadata, scale: float, options: AttentionOptions = CAUSAL) -> torch.Tensor:
        elementwise.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        tables, lens = per_token_contexts(metadata)
        decode = decode_attention(kv_cache.dtype, self.use_c_kernel and kv_cache.device.type == "cpu")
        if decode is cpu_decode.paged_decode_attention:
            return decode(query, kv_cache, tables, lens, int(lens.max()), scale, options)
        return torch.cat([decode(query[row:row + 1], kv_cache, tables[row:row + 1], lens[row:row + 1],
                                 int(lens[row]), scale, options) for row in range(query.shape[0])])


def per_token_contexts(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block table, context length) of every query token of the step: a prompt's i-th new token sees
    the cache up to and including itself."""
    starts, lens = metadata.query_start_list, metadata.seq_lens_list
    rows: list[int] = []
    contexts: list[int] = []
    for sequence, seq_len in enumerate(lens):
        new = starts[sequence + 1] - starts[sequence]
        rows += [sequence] * new
        contexts += range(seq_len - new + 1, seq_len + 1)
    index = torch.tensor(rows, dtype=torch.long, device=metadata.block_tables.device)
    return metadata.block_tables.index_select(0, index), torch.tensor(contexts, dtype=torch.int32,
                                                                       device=metadata.seq_lens.device)
