"""CUDA graphs of decode-only steps: one captured forward pass per batch-size bucket, then replays.

A decode step's shapes depend on its batch size alone, so the graph of a bucket serves any batch up
to that size. The step's tensors are copied into static buffers the graph reads; the rows past the
batch are padding that touches nothing:

    rows        0 .. batch-1          batch .. bucket-1
    slot        the token's slot      -1 (the cache write skips it)
    seq_len     cached + 1            0  (attention gives zeros, reads no block)

Block tables keep a row per request of the longest context, so any step's table fits; columns past
a row's blocks are never read. Everything else (prefills, mixed steps, batches over the largest
bucket captured) runs eagerly.

Every bucket up to the engine's `max_num_seqs` is captured by `capture`, at warm-up, before the
worker serves: largest first, so that the smaller ones reuse its memory pool, each after one eager
run that compiles the Triton kernels (nothing may compile inside a capture), on padding rows alone
(no cache write). Serving never captures: a capture while serving would race the threads that
allocate landing buffers and drive the KV transfer. Captures run in thread-local mode, so that such
a thread's CUDA calls neither break a capture nor are refused during it. Attention is captured for
the longest context (`max_model_len`), which fixes its split-K factor per bucket. A bucket whose
capture fails runs eagerly, with a warning. The graphs need the Triton backend: the torch backend's
gather would be sized for the longest context at every step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from cluster.model.attention.backend import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

logger = logging.getLogger(__name__)


Recorder = Callable[[Callable[[], torch.Tensor], Any], tuple[Callable[[], None], torch.Tensor]]


def record_cuda_graph(forward: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture `forward` as a CUDA graph in `pool`: its replay, and the output every replay rewrites.
    Thread-local: another thread's CUDA calls (a transfer's copies) go on meanwhile and are not captured."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        hidden = forward()
    return graph.replay, hidden


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_blocks_per_request: int,
                 max_model_len: int, buckets: tuple[int, ...] = BUCKETS, record: Recorder = record_cuda_graph,
                 new_pool: Callable[[], Any] = lambda: torch.cuda.graph_pool_handle()) -> None:
        """`record` and `new_pool`: CUDA's, unless a test stands in for them on a CPU."""
        self.record, self.new_pool = record, new_pool
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = buckets
        device, size = kv_caches[0].device, buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(size, max_blocks_per_request, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.pool: Any = None  # one CUDA graph memory pool shared by every bucket
        self.enabled = True

    def bucket_for(self, metadata: AttentionMetadata) -> int | None:
        """The captured bucket a step replays in, or None when it must run eagerly."""
        num_seqs = len(metadata.seq_lens_list)
        if not self.enabled or metadata.num_decodes != num_seqs:
            return None
        bucket = next((bucket for bucket in self.buckets if bucket >= num_seqs), None)
        return bucket if bucket in self.graphs else None

    def capture(self, max_num_seqs: int) -> list[int]:
        """Capture every bucket a step of at most `max_num_seqs` sequences replays in, largest first;
        the buckets captured (one that fails is left out, with a warning)."""
        largest = next((bucket for bucket in self.buckets if bucket >= max_num_seqs), self.buckets[-1])
        for bucket in sorted((b for b in self.buckets if b <= largest), reverse=True):
            if bucket not in self.graphs:
                self._capture(bucket)
        return sorted(self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            bucket: int) -> torch.Tensor:
        """Hidden states of the step's tokens ([batch, hidden]) by the bucket's replay, valid until the
        next replay."""
        self._load(input_ids, positions, metadata, bucket)
        replay, hidden = self.graphs[bucket]
        replay()
        return hidden[:input_ids.shape[0]]

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
              bucket: int) -> None:
        batch, width = input_ids.shape[0], metadata.block_tables.shape[1]
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(metadata.slot_mapping)
        self.slot_mapping[batch:bucket].fill_(-1)
        self.seq_lens[:batch].copy_(metadata.seq_lens)
        self.seq_lens[batch:bucket].zero_()
        self.block_tables[:batch, :width].copy_(metadata.block_tables)

    def _capture(self, bucket: int) -> None:
        """Capture the bucket's graph on padding rows: no token, no cache write."""
        self.slot_mapping[:bucket].fill_(-1)
        self.seq_lens[:bucket].zero_()
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket], query_start_loc=self.query_start_loc[:bucket + 1],
            num_decodes=bucket, max_seq_len=self.max_model_len, seq_lens_list=[self.max_model_len] * bucket,
            query_start_list=list(range(bucket + 1)))

        def forward() -> torch.Tensor:
            return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, metadata)

        forward()  # compiles the kernels: nothing may compile inside a capture
        if self.pool is None:
            self.pool = self.new_pool()
        try:
            self.graphs[bucket] = self.record(forward, self.pool)
        except RuntimeError as error:
            logger.warning("CUDA graph capture of %d sequences failed, their decode steps run eagerly: %s", bucket,
                           error)
            return
        logger.info("captured the CUDA graph of decode steps of up to %d sequences", bucket)
