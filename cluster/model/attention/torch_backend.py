"""The torch attention backend over the paged KV cache (the CPU path): torch ops and, where the
machine has a C compiler, the C decode kernel (`kernels/pdserve_kernels/cpu_decode.c`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cluster.model import elementwise
from cluster.model.attention.backend import AttentionMetadata
from pdserve_kernels import cpu_decode, reference, torch_decode, torch_prefill
from pdserve_kernels.reference import CAUSAL, AttentionOptions


class TorchAttentionBackend:
    """Batched decodes (the C kernel, else torch ops: `decode_attention`), prefills one sequence at a
    time (SDPA in fp32 and on CPUs with AMX, chunked bf16 matmuls otherwise: `pdserve_kernels.torch_prefill`),
    with the step's own keys where a prompt has no cached prefix. `use_c_kernel` set False gives the
    torch ops, `use_chunked_prefill` True or False the chunks or SDPA whatever the CPU (None: by the
    CPU); on the class or an instance: the benchmarks compare them in one run."""

    name = "torch"
    use_c_kernel = True
    use_chunked_prefill: bool | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,  # noqa: PLR0913
                metadata: AttentionMetadata, scale: float, options: AttentionOptions = CAUSAL) -> torch.Tensor:
        elementwise.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        decode = decode_attention(kv_cache.dtype, self.use_c_kernel and kv_cache.device.type == "cpu")
        decodes = metadata.num_decodes
        if decodes == len(metadata.seq_lens_list):
            return decode(query, kv_cache, metadata.block_tables, metadata.seq_lens, metadata.max_seq_len, scale,
                          options)
        out = torch.empty_like(query)
        if decodes:
            out[:decodes] = decode(
                query[:decodes], kv_cache, metadata.block_tables[:decodes], metadata.seq_lens[:decodes],
                max(metadata.seq_lens_list[:decodes]), scale, options)
        first = metadata.query_start_list[decodes]
        starts = [start - first for start in metadata.query_start_list[decodes:]]
        chunked = reference.attention_dtype(kv_cache, query) != torch.float32 and (
            not torch_prefill.sdpa_is_faster() if self.use_chunked_prefill is None else self.use_chunked_prefill)
        prefill = torch_prefill.paged_prefill_attention if chunked else reference.paged_prefill_attention
        out[first:] = prefill(
            query[first:], kv_cache, metadata.block_tables[decodes:], starts, metadata.seq_lens_list[decodes:], scale,
            key=key[first:], value=value[first:], options=options)
        return out


def decode_attention(dtype: torch.dtype, use_c_kernel: bool = True) -> Callable[..., torch.Tensor]:
    """The C kernel (reads the paged cache in place) where it builds and serves the dtype; else SDPA
    in fp32 and grouped matmuls in bf16 and fp16, where SDPA's masked GQA path on CPUs is slow.
    docs/performance.md has the figures."""
    if use_c_kernel and cpu_decode.available(dtype):
        return cpu_decode.paged_decode_attention
    return reference.paged_decode_attention if dtype == torch.float32 else torch_decode.paged_decode_attention
