"""Turns a `SchedulerOutput` into one flat forward pass and samples the next tokens.

It owns the model, the paged KV cache tensors (one per layer), the host copies of swapped-out
blocks and the host KV tier's memory. Batch tensors are built per request with numpy, never per token in Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cluster.common.events import TokenLogprobs
from cluster.engine.scheduler_output import HostCopies, ScheduledRequest, SchedulerOutput, SwapOrder
from cluster.model import batch_invariant
from cluster.model.architecture import ArchitectureConfig
from cluster.model.attention.backend import AttentionBackend, AttentionMetadata
from cluster.model.attention.registry import get_attention_backend
from cluster.model.cuda_graphs import DecodeGraphs
from cluster.model.grammar_masks import GrammarMasker
from cluster.model.host_kv import HostKVCache, as_bytes
from cluster.model.memory import DeviceMemory, profile_metadata
from cluster.model.models.llama import LlamaForCausalLM
from cluster.model.quantized import quantize_modules
from cluster.model.registry import model_class_for
from cluster.model.rejection_sampler import position_views, verify
from cluster.model.sampler import Sampler
from cluster.model.tensor_parallel import (
    TensorParallelGroup,
    reduce_row_parallel_outputs,
    shard_architecture,
    shard_weights,
)

# glibc serves allocations above 32 MiB with fresh (zero-filled) pages from mmap.
LARGE_ALLOCATION_BYTES = 64 * 2**20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
PROMPT_LOGPROBS_ROWS = 512  # prompt positions whose logits one lm-head call computes, for prompt logprobs
# The fp8 ones for KV caches only (`CacheConfig.kv_cache_dtype`).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e5m2": torch.float8_e5m2, "float8_e4m3fn": torch.float8_e4m3fn}


@dataclass(slots=True)
class ModelRunnerOutput:
    # Per request that sampled, its new tokens in order: one, or with drafts its accepted ones and one more.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per new token, where asked
    # Requests asking prompt logprobs: those of the prompt tokens this step's positions predict, in order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass(slots=True)
class Batch:
    rows: list[ScheduledRequest]
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: list[int]  # rows whose last position is sampled
    logits_indices: torch.Tensor  # the positions whose logits are computed: each sampled row's last 1 + drafts
    speculative: bool = False  # some sampled row has drafts


def keep_freed_host_memory() -> None:
    """Stop glibc handing freed multi-megabyte blocks back to the OS.

    Otherwise every step's large temporaries (gathered keys and values, activations) come back as
    fresh pages and are page-faulted in again, which makes the CPU attention gather several times
    slower. Allocations of 32 MiB and more still come fresh (and zeroed) from mmap.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
    libc.mallopt(M_TRIM_THRESHOLD, 2**30)


@contextlib.contextmanager
def skip_weight_init() -> Iterator[None]:
    """Layers fill new weights randomly: wasted work for weights the checkpoint overwrites anyway
    (`load_weights` fails if any parameter is left unloaded), and on the meta device torch's random
    fills import its compiler stack (150 MB of host memory)."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    for name in names:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def build_model(arch: ArchitectureConfig, backend: AttentionBackend, max_positions: int, dtype: torch.dtype,
                device: torch.device, quantized: Mapping[str, str] | None = None) -> LlamaForCausalLM:
    """The model with its parameters allocated once, in `dtype` on `device`, unset until `load_weights`.

    Built on the meta device (shapes only: no memory, no random init) and materialised in its final
    dtype: built in fp32 and then cast, an 8B model would peak at 32 GB of fp32 plus 16 of bf16, and
    a GPU's caching allocator would keep the 32 reserved. The `torch.device` context is thread-local
    (the process-wide default dtype is not), so engines may load on several threads at once.
    """
    with torch.device("meta"), skip_weight_init():
        model = model_class_for(arch.architecture)(arch, backend, max_positions=max_positions).to(dtype)
        if quantized:  # after the cast, which would widen fp8 weights and round float32 scales
            quantize_modules(model, dict(quantized), dtype)
    materialize(model, device)
    model.rotary.fill(dtype)  # the one buffer the checkpoint does not hold
    return model


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate each parameter and buffer of a meta-device model on `device`, uninitialised; a tensor
    two modules share (tied embeddings) stays shared. Not `Module.to_empty`: its meta `empty_like`
    imports torch's symbolic-shape stack (sympy), tens of MB of host memory."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, meta in table.items():
                if meta is None:
                    continue
                if id(meta) not in made:
                    empty = torch.empty(meta.shape, dtype=meta.dtype, device=device)
                    is_parameter = isinstance(meta, torch.nn.Parameter)
                    made[id(meta)] = torch.nn.Parameter(empty, meta.requires_grad) if is_parameter else empty
                table[name] = made[id(meta)]


def allocate_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache tensor. Zeros matter: attention multiplies masked-out slots by zero, and a
    NaN left in one would survive that. On the CPU, allocations this large come from the OS already
    zeroed and are paged in only when written, so `empty` spares touching gigabytes up front."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type == "cpu" and size >= LARGE_ALLOCATION_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def kv_block_bytes(arch: ArchitectureConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * element


class ModelRunner:
    def __init__(self, arch: ArchitectureConfig, weights: Iterable[tuple[str, torch.Tensor]], *,  # noqa: PLR0913
                 dtype: str, device: str, attention_backend: str, max_model_len: int,
                 block_size: int, num_blocks: int, kv_cache_dtype: str | None = None,
                 deterministic: bool = False, quantized: Mapping[str, str] | None = None,
                 group: TensorParallelGroup | None = None) -> None:
        """`quantized`: the parameters whose weights arrive quantized (name -> GGUF quantization, or 8-bit
        qtype of `cluster.model.scaled`), kept so.
        `group`: this runner is one rank of a tensor-parallel engine (`cluster.model.tensor_parallel`):
        it builds and loads its shard of `arch` from the whole checkpoint's `weights`; rank 0 sends the
        weights, and every step, to the other ranks, which run the same calls (`cluster.model.ranks`)."""
        self.arch = arch
        self.group = group
        self.local_arch = shard_architecture(arch, group.size) if group is not None else arch  # its heads
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.kv_dtype = DTYPES[kv_cache_dtype or dtype]  # the cache's: the model's, or fp8
        self.block_size = block_size
        if self.device.type == "cpu":
            keep_freed_host_memory()
        if deterministic and arch.moe is not None:
            raise ValueError("deterministic mode does not cover mixture-of-experts models: each expert's matmul "
                             "has as many rows as tokens chose it, so its sums depend on the batch")
        backend = get_attention_backend(attention_backend, self.device, deterministic)
        model = build_model(self.local_arch, backend, max_model_len, self.dtype, self.device, quantized or {})
        model.load_weights(self._shard(weights))  # each tensor cast to the parameter's dtype as it is copied in
        if deterministic:
            batch_invariant.tile_linear_layers(model)
        if group is not None:
            reduce_row_parallel_outputs(model, group)
        self.model = model.eval()
        self.backend_name = backend.name
        self.swap_store: dict[str, list[torch.Tensor]] = {}
        self.host_kv: HostKVCache | None = None  # the host tier's slots (`allocate_host_kv`)
        self.sampler = Sampler(arch.vocab_size)
        self.grammar_masker = GrammarMasker()
        self.kv_caches: list[torch.Tensor] = []
        self.block_tables = BlockTables(-(-max_model_len // block_size))
        # Decode-only steps replay as CUDA graphs on CUDA devices with Triton attention (None: all eager).
        self.decode_graphs: DecodeGraphs | None = None
        if num_blocks:
            self.allocate_kv_cache(num_blocks, max_model_len)

    @property
    def leads(self) -> bool:
        """Rank 0 of a tensor-parallel engine: what it runs, the other ranks run too."""
        return self.group is not None and self.group.rank == 0

    def _shard(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as this rank loads them; rank 0 sends each whole to the others first."""
        group = self.group
        if group is None:
            return weights
        if group.rank == 0:
            weights = group.broadcast_weights(weights)
        return shard_weights(weights, self.arch, group.rank, group.size)

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """The paged KV cache, once its size is known (after `profile_peak` where the engine sizes it
        from the device's memory), and what is sized by the context: block tables, decode graphs. Each
        rank's cache holds its own KV heads."""
        if self.leads:
            assert self.group is not None
            self.group.send("allocate", num_blocks=num_blocks, max_model_len=max_model_len)
        arch = self.local_arch
        shape = (2, num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [allocate_zeroed(shape, self.kv_dtype, self.device) for _ in range(arch.num_layers)]
        self.block_tables = BlockTables(-(-max_model_len // self.block_size))
        # Not for mixtures of experts (their layers read each expert's row count on the host, which a
        # capture cannot), nor with several ranks (graphs would capture the all-reduces too, and every
        # rank would replay its own): eager instead.
        if self.device.type == "cuda" and self.backend_name == "triton" and arch.moe is None and self.group is None:
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.block_tables.table.shape[1],
                                              max_model_len)

    def allocate_host_kv(self, num_slots: int, disk_dir: str = "") -> None:
        """Host memory for the host KV tier's `num_slots` blocks (after `allocate_kv_cache`), or a file
        in `disk_dir`; on a tensor-parallel engine every rank holds its own heads' share of each slot."""
        if self.leads:
            assert self.group is not None
            self.group.send("allocate_host", num_slots=num_slots, disk_dir=disk_dir)
        self.host_kv = HostKVCache(num_slots, self.kv_caches, disk_dir)

    def copy_host_blocks(self, copies: HostCopies) -> None:
        """The host tier's copies queued outside a step (blocks a reservation evicted): before any
        write into those blocks. Every rank makes them, on its own heads."""
        if copies and self.leads:
            assert self.group is not None
            self.group.send("host_copies", host=host_copy_lists(copies))
        self._swap([], [], copies)

    def follow_host_copies(self, host: list[list[int]]) -> None:
        """Ranks > 0: rank 0's `copy_host_blocks` (`host_copy_lists`), on this rank's heads."""
        self._swap([], [], HostCopies(*host))

    def weights_bytes(self) -> int:
        """The device memory the model holds: parameters and buffers, a shared tensor once."""
        tensors = {id(t): t for t in (*self.model.parameters(), *self.model.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @torch.inference_mode()
    def profile_peak(self, memory: DeviceMemory, num_tokens: int, logits_rows: int) -> int:
        """The activations' peak of the largest step: `num_tokens` prompt tokens (in sequences of the
        model's context at most) and the logits of `logits_rows` of them, over a KV cache just large
        enough, allocated before the measure and freed after. Every rank runs it; rank 0's is measured."""
        if self.leads:
            assert self.group is not None
            self.group.send("profile", num_tokens=num_tokens, logits_rows=logits_rows)
        step, caches = self._profile_step(num_tokens, logits_rows)
        try:
            return memory.peak_during(step)
        finally:
            caches.clear()

    @torch.inference_mode()
    def follow_profile(self, num_tokens: int, logits_rows: int) -> None:
        """Ranks > 0: rank 0's `profile_peak` step, whose all-reduces need every rank."""
        step, caches = self._profile_step(num_tokens, logits_rows)
        step()
        caches.clear()

    def _profile_step(self, num_tokens: int, logits_rows: int) -> tuple[Callable[[], None], list[torch.Tensor]]:
        max_len = self.model.rotary.cos.shape[0]
        metadata, positions, num_blocks = profile_metadata(num_tokens, max_len, self.block_size, self.device)
        arch = self.local_arch
        shape = (2, num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(arch.num_layers)]

        def step() -> None:
            hidden = self.model(input_ids, positions, caches, metadata)
            logits = self.model.compute_logits(hidden[:logits_rows])
            logits.softmax(dim=-1).sort(dim=-1, descending=True)  # as a top-p sampler's copies of the logits

        return step, caches

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.build_batch(output.scheduled) if output.scheduled else None
        if self.leads:
            self._send_step(output, batch)
        self._swap(output.swap_out, output.swap_in, output.host_copies)
        if batch is None:
            return ModelRunnerOutput()
        sampling = [batch.rows[row] for row in batch.sample_rows]
        drafts = [s.draft_token_ids for s in sampling] if batch.speculative else []
        # One request per logits row: with drafts, each drafted request at each of its positions.
        requests = [view for s in sampling for view in position_views(s.request, s.draft_token_ids)] \
            if batch.speculative else [s.request for s in sampling]
        grammar_masks = self.grammar_masker.start(requests)  # computed while the model runs
        hidden = self._forward(batch)
        result = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(batch, hidden))
        if not batch.sample_rows:
            return result
        logits = self.model.compute_logits(hidden[batch.logits_indices], upcast=False)  # the sampler widens
        masks = grammar_masks.result() if grammar_masks is not None else None
        if batch.speculative:
            verified = verify(self.sampler, logits, requests, drafts, masks)
            for s, token_ids, logprobs in zip(sampling, verified.token_ids, verified.logprobs, strict=True):
                result.sampled[s.request.request_id] = token_ids
                if logprobs:
                    result.logprobs[s.request.request_id] = logprobs
            return result
        sampled = self.sampler(logits, requests, masks)
        for request, token_id, token_logprobs in zip(requests, sampled.token_ids, sampled.logprobs, strict=True):
            result.sampled[request.request_id] = [token_id]
            if token_logprobs is not None:
                result.logprobs[request.request_id] = [token_logprobs]
        return result

    def _prompt_logprobs(self, batch: Batch, hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """For rows owed prompt logprobs, those of the prompt tokens their positions predict: the lm
        head runs over those positions only, chunk by chunk as the prompt computes, and over at most
        `PROMPT_LOGPROBS_ROWS` positions at once (a full vocabulary's logits per position add up)."""
        result: dict[str, list[TokenLogprobs]] = {}
        for row, scheduled in enumerate(batch.rows):
            span = prompt_logprob_span(scheduled, batch.metadata.query_start_list[row])
            if span is None:
                continue
            first_index, count, first_position = span
            request = scheduled.request
            k = request.sampling_params.prompt_logprobs or 0
            entries = result[request.request_id] = []
            for offset in range(0, count, PROMPT_LOGPROBS_ROWS):
                rows = min(PROMPT_LOGPROBS_ROWS, count - offset)
                logits = self.model.compute_logits(hidden[first_index + offset:first_index + offset + rows])
                targets = request.prompt_token_ids[first_position + offset + 1:first_position + offset + 1 + rows]
                entries += token_logprobs(logits[:, : self.arch.vocab_size].float().log_softmax(dim=-1), targets, k)
        return result

    def _swap(self, swap_out: list[SwapOrder], swap_in: list[SwapOrder], host_copies: HostCopies | None = None) -> None:
        """Every read of a block's old KV (offloads to the host tier, swap-outs of preempted requests)
        before any write into the blocks this step took (promotions, swap-ins)."""
        host_kv = self.host_kv if host_copies else None
        if host_kv is not None:
            assert host_copies is not None
            host_kv.offload(self.kv_caches, host_copies.offload_blocks, host_copies.offload_slots)
        for order in swap_out:
            self._swap_out(order)
        if host_kv is not None:
            assert host_copies is not None
            host_kv.load(self.kv_caches, host_copies.load_slots, host_copies.load_blocks)
        for order in swap_in:
            self._swap_in(order)

    def _send_step(self, output: SchedulerOutput, batch: Batch | None) -> None:
        """Rank 0: the step's swaps and batch to the other ranks, which run it with `follow_step`."""
        assert self.group is not None
        orders: dict[str, Any] = {"swap_out": [[o.request_id, o.block_ids] for o in output.swap_out],
                  "swap_in": [[o.request_id, o.block_ids] for o in output.swap_in],
                  "host": host_copy_lists(output.host_copies) if output.host_copies else None}
        if batch is None:
            self.group.send("step", **orders)
            return
        metadata = batch.metadata
        tensors = [batch.input_ids, batch.positions, metadata.slot_mapping, metadata.block_tables,
                   metadata.seq_lens, metadata.query_start_loc]
        self.group.send("step", tensors, num_decodes=metadata.num_decodes, max_seq_len=metadata.max_seq_len, **orders)

    @torch.inference_mode()
    def follow_step(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        """Ranks > 0: rank 0's step (`_send_step`): the same swaps and forward pass over this rank's heads."""
        self._swap([SwapOrder(rid, ids) for rid, ids in header["swap_out"]],
                   [SwapOrder(rid, ids) for rid, ids in header["swap_in"]],
                   HostCopies(*header["host"]) if header.get("host") else None)
        if not tensors:
            return
        input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc = tensors
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
            num_decodes=header["num_decodes"], max_seq_len=header["max_seq_len"],
            seq_lens_list=seq_lens.tolist(), query_start_list=query_start_loc.tolist())
        self.model(input_ids, positions, self.kv_caches, metadata)

    def capture_decode_graphs(self, max_num_seqs: int) -> list[int]:
        """Capture the decode steps' CUDA graphs (`DecodeGraphs.capture`) before serving: the batch
        sizes captured, none without graphs."""
        if self.decode_graphs is None:
            return []
        with torch.inference_mode():
            return self.decode_graphs.capture(max_num_seqs)

    def _forward(self, batch: Batch) -> torch.Tensor:
        """A CUDA graph replay for a decode-only step that fits a bucket, else the eager model."""
        graphs = self.decode_graphs
        bucket = graphs.bucket_for(batch.metadata) if graphs is not None else None
        if graphs is None or bucket is None:
            return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata)
        return graphs.run(batch.input_ids, batch.positions, batch.metadata, bucket)

    def build_batch(self, scheduled: list[ScheduledRequest]) -> Batch:
        return build_batch(scheduled, self.block_tables, self.block_size, self.device)

    def release(self, request_id: str) -> None:
        """Forget per-request state (sampler generators, swapped KV, table row) of a request that ended."""
        self.sampler.free(request_id)
        if self.swap_store.pop(request_id, None) is not None and self.leads:
            assert self.group is not None
            self.group.send("release", request_id=request_id)  # the other ranks' swapped KV of it
        self.block_tables.release(request_id)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of blocks' KV, block-major so that any run of blocks is one contiguous
        byte range (a transfer frame): [blocks, layers, 2, block_size, kv_heads, head_dim], every KV
        head of the model: on a tensor-parallel engine rank 0 gathers the other ranks' heads, so
        what leaves an engine never depends on how many ranks it has."""
        if not self.leads:
            return self._read_local(block_ids)
        assert self.group is not None
        self.group.send("read", block_ids=block_ids)
        parts = self.group.gather_to_first(as_bytes(self._read_local(block_ids)))
        return torch.cat(parts, dim=4).to(self.device).view(self.kv_dtype)

    def follow_read(self, block_ids: list[int]) -> None:
        """Ranks > 0: this rank's heads of rank 0's `read_blocks`, gathered there."""
        assert self.group is not None
        self.group.gather_to_first(as_bytes(self._read_local(block_ids)))

    def _read_local(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(block_ids, device=self.device)
        return torch.stack([cache.index_select(1, index) for cache in self.kv_caches], dim=1).transpose(0, 2) \
            .contiguous()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write KV laid out as `read_blocks` returns it (every KV head of the model) into the given
        blocks; on a tensor-parallel engine rank 0 sends it to the other ranks and each writes its own
        heads. `data`'s memory may be reused once this returns: on a GPU it waits for the copies it
        queued."""
        expected = self.kv_blocks_shape(len(block_ids))
        if tuple(data.shape) != expected or data.dtype != self.kv_dtype:
            raise ValueError(f"KV of shape {tuple(data.shape)} {data.dtype} does not fit blocks "
                             f"{expected} {self.kv_dtype}")
        if self.leads:
            assert self.group is not None
            self.group.send("write", [as_bytes(data)], block_ids=block_ids)
        self._write_local(block_ids, self._my_heads(data))

    def kv_blocks_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of `num_blocks` blocks' KV as `read_blocks` returns it: every KV head of the model."""
        arch = self.arch
        return num_blocks, arch.num_layers, 2, self.block_size, arch.num_kv_heads, arch.head_dim

    def follow_write(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Ranks > 0: this rank's heads of rank 0's `write_blocks` (`data` as bytes, every head)."""
        self._write_local(block_ids, self._my_heads(data.view(self.kv_dtype)))

    def _my_heads(self, data: torch.Tensor) -> torch.Tensor:
        """This rank's KV heads of KV laid out as `read_blocks` returns it."""
        if self.group is None:
            return data
        return data.chunk(self.group.size, dim=4)[self.group.rank]

    def _write_local(self, block_ids: list[int], data: torch.Tensor) -> None:
        index = torch.tensor(block_ids, device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            as_bytes(cache).index_copy_(1, index, as_bytes(data[:, layer].transpose(0, 1).to(self.device)))
        if self.device.type == "cuda":
            # A landing buffer on the device is freed when this returns, and the caching allocator may
            # hand its memory to the next transfer at once: UCX writes it off this stream, so a copy
            # still queued would read the next prompt's KV.
            torch.cuda.current_stream(self.device).synchronize()

    def _swap_out(self, order: SwapOrder) -> None:
        index = torch.tensor(order.block_ids, device=self.device)
        self.swap_store[order.request_id] = [cache[:, index].to("cpu") for cache in map(as_bytes, self.kv_caches)]

    def _swap_in(self, order: SwapOrder) -> None:
        index = torch.tensor(order.block_ids, device=self.device)
        for cache, saved in zip(map(as_bytes, self.kv_caches), self.swap_store.pop(order.request_id), strict=True):
            cache[:, index] = saved.to(self.device)


def host_copy_lists(copies: HostCopies) -> list[list[int]]:
    """A step's host-tier copies as plain lists, for the other ranks (`HostCopies(*lists)` again)."""
    return [copies.offload_blocks, copies.offload_slots, copies.load_slots, copies.load_blocks]


class BlockTables:
    """Every live request's block table as a row of one numpy array, kept across steps.

    A step copies in only what changed (a decode adds a block every `block_size` tokens), so
    building the batch's tables is one gather, not a conversion of every block id from Python.
    A row is rewritten whole when the request's block list is a new list (it was preempted).
    """

    def __init__(self, max_blocks_per_request: int, rows: int = 64) -> None:
        self.table = np.zeros((rows, max_blocks_per_request), np.int64)
        self.row_of: dict[str, int] = {}
        self.source: list[list[int] | None] = [None] * rows  # the block list each row mirrors
        self.count = [0] * rows
        self.free_rows = list(range(rows - 1, -1, -1))

    def rows_for(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        rows = np.empty(len(scheduled), np.int64)
        for index, s in enumerate(scheduled):
            row = self.row_of.get(s.request.request_id)
            if row is None:
                row = self._assign(s.request.request_id)
            block_ids, count = s.block_ids, self.count[row]
            if self.source[row] is not block_ids:
                self.source[row], count = block_ids, 0
            if len(block_ids) != count:
                self.table[row, count:len(block_ids)] = block_ids[count:]
                self.count[row] = len(block_ids)
            rows[index] = row
        return rows

    def release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.source[row], self.count[row] = None, 0
            self.free_rows.append(row)

    def _assign(self, request_id: str) -> int:
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.row_of[request_id] = row
        return row

    def _grow(self) -> None:
        old = len(self.source)
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.source += [None] * old
        self.count += [0] * old
        self.free_rows = list(range(2 * old - 1, old - 1, -1))


def build_batch(scheduled: list[ScheduledRequest], block_tables: BlockTables, block_size: int,
                device: torch.device) -> Batch:
    """Flat tensors for one forward pass over every scheduled token: one pass in Python over the
    requests, then numpy over the tokens."""
    # Decodes (one new token) first: the attention backend batches them together.
    rows = [s for s in scheduled if s.num_new_tokens == 1] + [s for s in scheduled if s.num_new_tokens != 1]
    starts, lengths, token_ids, sample_rows = [], [], [], []
    speculative = False
    for index, s in enumerate(rows):
        start, length = s.request.num_computed_tokens, s.num_new_tokens
        starts.append(start)
        lengths.append(length)
        if s.draft_token_ids:  # the drafts run after the request's last token
            token_ids += s.request.all_token_ids[start:start + length - len(s.draft_token_ids)]
            token_ids += s.draft_token_ids
            speculative = True
        else:
            token_ids += s.request.all_token_ids[start:start + length]
        if s.samples:
            sample_rows.append(index)
    lengths_array = np.array(lengths)
    query_start = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(lengths_array, out=query_start[1:])
    row_of_token = np.repeat(np.arange(len(rows)), lengths_array)
    positions = np.arange(len(token_ids)) - query_start[row_of_token] + np.array(starts)[row_of_token]
    seq_lens = positions[query_start[1:] - 1] + 1
    max_blocks = -(-int(seq_lens.max()) // block_size)
    table_rows = block_tables.rows_for(rows)  # may grow the table: index it only afterwards
    tables = block_tables.table[table_rows, :max_blocks]
    slot_mapping = tables[row_of_token, positions // block_size] * block_size + positions % block_size
    to_device = functools.partial(_to_device, device=device)
    metadata = AttentionMetadata(
        slot_mapping=to_device(slot_mapping), block_tables=to_device(tables),
        seq_lens=to_device(seq_lens.astype(np.int32)), query_start_loc=to_device(query_start.astype(np.int32)),
        num_decodes=len(rows) - int(np.count_nonzero(lengths_array - 1)), max_seq_len=int(seq_lens.max()),
        seq_lens_list=seq_lens.tolist(), query_start_list=query_start.tolist())
    logits_indices = _speculative_indices(rows, sample_rows, query_start) if speculative \
        else query_start[1:][sample_rows] - 1
    return Batch(rows, torch.tensor(token_ids, dtype=torch.int64, device=device), to_device(positions),
                 metadata, sample_rows, to_device(logits_indices), speculative)


def _speculative_indices(rows: list[ScheduledRequest], sample_rows: list[int], query_start: np.ndarray) -> np.ndarray:
    """The flat positions of each sampled row's last token and drafts, row after row."""
    ends = query_start[1:]
    return np.concatenate([np.arange(ends[row] - 1 - len(rows[row].draft_token_ids), ends[row])
                           for row in sample_rows])


def prompt_logprob_span(scheduled: ScheduledRequest, query_start: int) -> tuple[int, int, int] | None:
    """(first flat index, count, first position) of a row's positions whose logits give prompt logprobs
    still owed (position p predicts prompt token p + 1), or None. Positions computed again (after a
    recompute preemption) are skipped: their logprobs are in already."""
    request = scheduled.request
    if not request.num_prompt_logprobs_due:
        return None
    start = request.num_computed_tokens
    first = max(start, len(request.prompt_logprobs))
    end = min(start + scheduled.num_new_tokens, request.num_prompt_tokens - 1)
    if first >= end:
        return None
    return query_start + first - start, end - first, first


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Each row's logprob of its token, that token's rank (1: the most likely) and the row's top k."""
    targets = torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, targets)
    ranks = (logprobs > chosen).sum(dim=1).add(1).tolist()
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return [TokenLogprobs(token_id, logprob, list(zip(ids, values, strict=True)), rank)
            for token_id, logprob, ids, values, rank in zip(token_ids, chosen.squeeze(1).tolist(), top_ids.tolist(),
                                                            top_values.tolist(), ranks, strict=True)]


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)
