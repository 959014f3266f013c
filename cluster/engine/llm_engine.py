"""The engine core: requests in, tokens out, one `step()` at a time. No I/O, no threads.

A step asks the scheduler what to run, has the model runner run it, then advances each request,
detokenizes its new token, checks stop strings, and reports what changed. Workers (Ray actors,
later) wrap this loop; everything here is plain Python and torch.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cluster.common.block_hashes import prefix_hashes
from cluster.common.events import FinishReason, TokenLogprobs
from cluster.common.loads import BucketCounts
from cluster.common.sampling_params import SamplingParams
from cluster.engine.block_pool import BlockPool
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from cluster.engine.host_tier import HostTier
from cluster.engine.kv_cache_manager import KVCacheManager
from cluster.engine.prefix_pins import PrefixPins
from cluster.engine.request import Request, RequestStatus
from cluster.engine.request_stats import RequestStats
from cluster.engine.scheduler import Scheduler
from cluster.engine.scheduler_output import SchedulerOutput
from cluster.engine.spec_decode import DraftModelProposer, Proposer, SpecDecodeStats, build_proposer
from cluster.model.device import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from cluster.model.memory import CudaMemory, DeviceMemory, MemoryProfile, check_free
from cluster.model.ranks import Ranks, RankSpec
from cluster.model.registry import architecture_config
from cluster.model.runner import DTYPES, ModelRunner, kv_block_bytes
from cluster.model.tensor_parallel import check_tensor_parallel
from cluster.weights.default_model import DEFAULT_MODEL_NAME, gguf_source, resolve_model_path
from cluster.weights.detokenizer import IncrementalDetokenizer
from cluster.weights.gguf_packed import packed_checkpoint
from cluster.weights.loader import Checkpoint, load_checkpoint
from cluster.weights.scaled_safetensors import quantization_method, scaled_checkpoint
from cluster.weights.tokenizer import Tokenizer

if TYPE_CHECKING:
    from cluster.grammar.compiler import GrammarCompiler
    from cluster.grammar.matcher import GrammarMatcher

log = logging.getLogger(__name__)
WARM_UP_REQUEST_ID = "pdserve-warm-up"
WARM_UP_PROMPT_TOKENS = 256  # the prompt whose prefill `warm_up` times


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request. `text` and `token_ids` are everything so far;
    `token_ids` is the request's live list (copy it to keep it past the next step, or use `index`)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    index: int  # output tokens before `new_token_ids`: a snapshot, safe across threads
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # With the first output token, if asked: one per prompt token, None for the first (vLLM's shape).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class KVExport:
    """A run of a prefill's KV blocks, ready to send: `data` is [blocks, layers, 2, block_size, heads,
    dim], blocks `first_block` onwards of the request's. The last run carries the first token."""

    request_id: str
    num_tokens: int  # the prompt's
    first_block: int
    data: torch.Tensor
    first_token_id: int | None = None  # set on the last run: the prefill is finished

    @property
    def last(self) -> bool:
        return self.first_token_id is not None


@dataclass(frozen=True, slots=True)
class Reservation:
    """Where a decode worker takes a prompt (`LLMEngine.reserve_prompt`): its blocks, of which the
    leading `num_reused_blocks` came from this engine's prefix cache and the KV of the rest is to
    arrive; or, `local`, the prompt is computed here (no blocks reserved: it queues as any request)."""

    block_ids: list[int]
    num_reused_blocks: int = 0
    local: bool = False

    @property
    def num_to_receive(self) -> int:
        """Blocks whose KV a prefill worker sends: the landing buffer's size."""
        return len(self.block_ids) - self.num_reused_blocks


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_recomputes: int = 0  # decode side: prompts whose KV never came, computed here
    seconds_per_request: float = 0.0  # recent requests' time running here, first step to end (0: none yet)
    num_swapped: int = 0  # requests whose KV is swapped out to host memory
    histograms: dict[str, BucketCounts] = field(default_factory=dict)  # copies of `RequestStats`'
    spec_decode: SpecDecodeStats | None = None  # drafts verified and accepted; None: speculation is off
    host_kv: HostTierStats | None = None  # the host KV tier's; None: it is off
    # Decode side: prompt tokens whose KV this engine's prefix cache already held when the prompt came
    # (not sent by a prefill worker), and prompts computed here because their uncached part was short.
    num_reused_prompt_tokens: int = 0
    num_local_prefills: int = 0
    # Prefix blocks this engine sent to peer workers, and received from them (`cluster.engine.prefix_pins`).
    num_prefix_blocks_offered: int = 0
    num_prefix_blocks_fetched: int = 0


@dataclass(slots=True)
class HostTierStats:
    num_blocks: int
    num_used: int
    queries: int  # prompt tokens looked up in the host tier (past the device pool's hits)
    hits: int  # of those, found there
    offloaded: int  # blocks copied out of the device pool
    promoted: int  # blocks copied back in


def served_model_name(model: str) -> str:
    """The name users see: the default model's own name, else the file or directory name."""
    if model == "default":
        return DEFAULT_MODEL_NAME
    return Path(model).stem if model.endswith(".gguf") else Path(model).name


class LLMEngine:
    """One model's engine: tokenizer, weights, KV cache, scheduler and model runner, stepped by its caller.

    Owns everything a step needs and nothing else: no thread, no event loop, no network. `step()`
    schedules, runs the model once and returns a `RequestOutput` per request that made progress.
    Called by a `Worker` on the worker's engine thread (the cluster's path), or directly by library
    users, `pdserve generate|chat|bench` and the tests; every call must come from one thread. The
    disaggregation calls (`add_prefill`/`export_kv` on a prefill worker, `reserve_remote`/`import_kv`/
    `admit_remote` on a decode worker) move a request's KV between two engines without the engine
    knowing how the bytes travel.
    """

    def __init__(self, config: EngineConfig | None = None, *, progress: bool = False,
                 checkpoint: Checkpoint | None = None, memory: DeviceMemory | None = None) -> None:
        """`checkpoint`: a model in memory (`cluster.weights.synthetic.random_checkpoint`) rather than the
        files `config.model.model` points to, which then only names it. `memory`: how the device
        reports its memory, for sizing the KV cache by `gpu_memory_utilization`; None: CUDA's own on a
        CUDA device (elsewhere the size is fixed)."""
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.model.device)  # first: a missing GPU is refused before any loading
        self.dtype, self.dtype_reason = resolve_dtype(config.model.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.model_dir: Path | None = None
        if checkpoint is None:
            self.model_dir = resolve_model_path(config.model.model, progress=progress)
            checkpoint = load_checkpoint(self.model_dir)
            if config.model.quantization == "gguf":
                checkpoint = packed_checkpoint(checkpoint, gguf_source(config.model.model))
            else:
                checkpoint = scaled_checkpoint(checkpoint, self.model_dir, config.model.quantization)
        self.model_name = served_model_name(config.model.model)
        self.arch = architecture_config(checkpoint.hf_config)
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.memory = memory if memory is not None or self.device.type != "cuda" else CudaMemory(self.device)
        self.memory_profile: MemoryProfile | None = None  # where the KV cache is sized by utilization
        check_tensor_parallel(self.arch, config.model.tensor_parallel_size,
                              quantization_method(checkpoint.hf_config) or config.model.quantization)
        total = self._check_free_memory()
        options: dict[str, Any] = dict(
            dtype=self.dtype, device=str(self.device), attention_backend=config.attention_backend,
            max_model_len=self._context_limit(), block_size=config.cache.block_size, num_blocks=0,
            kv_cache_dtype=self.kv_cache_dtype, deterministic=config.model.deterministic,
            quantized=checkpoint.quantized)
        self.ranks = self._start_ranks(options)
        try:
            self.runner = ModelRunner(self.arch, checkpoint.weights(), **options,
                                      group=self.ranks.group if self.ranks is not None else None)
            self.num_blocks = self._num_blocks(total)
            self.max_model_len = self._max_model_len()
            self.runner.allocate_kv_cache(self.num_blocks, self.max_model_len)
            self.num_host_kv_blocks = self._num_host_kv_blocks()
            if self.num_host_kv_blocks:
                self.runner.allocate_host_kv(self.num_host_kv_blocks, config.cache.host_kv_disk_dir)
        except BaseException:
            self.close()
            raise
        host_tier = HostTier(self.num_host_kv_blocks) if self.num_host_kv_blocks else None
        pool = BlockPool(self.num_blocks, config.cache.enable_prefix_caching, host_tier)
        # Hashes chain from the served model name, so every worker of a cluster (and the routers that
        # match prompts against the blocks workers publish) compute the same ones, whatever the path.
        self.kv_cache = KVCacheManager(pool, config.cache.block_size, model_name=self.model_name)
        self.prefix_pins = PrefixPins(pool)  # blocks held for prefixes fetched from or by peer workers
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len,
                                   num_swap_blocks=config.cache.num_swap_blocks or self.num_blocks)
        self.proposer = self._proposer()  # drafts for speculative decoding; None: off
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.last_step_tokens = 0  # tokens the last step computed
        self.num_reused_prompt_tokens = 0  # see `EngineStats`
        self.num_local_prefills = 0
        self.ids = itertools.count()

    def _proposer(self) -> Proposer | None:
        if self.config.speculative.method != "draft_model":
            return build_proposer(self.config.speculative)
        try:
            draft = LLMEngine(self._draft_config())
        except BaseException:
            self.close()
            raise
        return DraftModelProposer(draft, self.arch.vocab_size)

    def _draft_config(self) -> EngineConfig:
        """The draft model's engine: this engine's device, dtype, block size and batch limits, a pool of as
        many blocks (every running request's tokens fit in it too), its own context, no speculation."""
        model, cache = self.config.model, self.config.cache
        assert self.config.speculative.model is not None
        return replace(
            self.config, speculative=SpeculativeConfig(),
            model=ModelConfig(model=self.config.speculative.model, dtype=str(self.dtype).removeprefix("torch."),
                              device=str(self.device), seed=model.seed, deterministic=model.deterministic),
            cache=CacheConfig(block_size=cache.block_size, num_blocks=self.num_blocks,
                              kv_cache_dtype=cache.kv_cache_dtype))

    def _start_ranks(self, options: dict[str, Any]) -> Ranks | None:
        """Ranks 1.. of a tensor-parallel engine (None at size 1), stopped by `close`, or when the engine
        is collected or the process exits without it."""
        size = self.config.model.tensor_parallel_size
        if size == 1:
            return None
        threads = max(1, torch.get_num_threads() // size)  # the ranks' share of what the engine computes on
        ranks = Ranks.start(size, RankSpec(self.arch, options, threads), self.device)
        self._stop_ranks = weakref.finalize(self, ranks.stop)
        return ranks

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any; the engine steps no more after this."""
        if isinstance(getattr(self, "proposer", None), DraftModelProposer):
            self.proposer.engine.close()  # type: ignore[union-attr]
        if self.ranks is not None:
            self._stop_ranks()  # runs `Ranks.stop` once, whoever calls first
            self.ranks = None

    def _utilization_memory(self) -> DeviceMemory | None:
        """The device's memory report where the KV cache is sized by `gpu_memory_utilization`, else None."""
        cache = self.config.cache
        return None if cache.num_blocks or cache.kv_cache_memory_gb is not None else self.memory

    def _check_free_memory(self) -> int:
        """Before loading: refuse an engine whose share of the device is not free. The device's total
        memory (0 where the KV cache is not sized by utilization)."""
        memory = self._utilization_memory()
        if memory is None:
            return 0
        free, total = memory.free_and_total()
        check_free(self.config.cache.gpu_memory_utilization, free, total)
        return total

    def _num_blocks(self, total: int) -> int:
        cache = self.config.cache
        if cache.num_blocks:
            return cache.num_blocks
        kv_dtype = DTYPES[self.kv_cache_dtype]
        memory = self._utilization_memory()
        if memory is None:  # a size for the engine: its ranks' caches together hold it
            gigabytes = cache.kv_cache_memory_gb or cache.cpu_kv_cache_memory_gb
            return max(1, int(gigabytes * 2**30) // kv_block_bytes(self.arch, cache.block_size, kv_dtype))
        # Each rank's device holds its own heads' share of every block.
        block_bytes = kv_block_bytes(self.runner.local_arch, cache.block_size, kv_dtype)
        scheduler = self.config.scheduler
        peak = self.runner.profile_peak(memory, scheduler.max_num_batched_tokens,
                                        min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens))
        self.memory_profile = MemoryProfile(cache.gpu_memory_utilization, total, self.runner.weights_bytes(), peak)
        log.info("%s", self.memory_profile.describe())
        return max(1, self.memory_profile.kv_cache_bytes // block_bytes)

    def _num_host_kv_blocks(self) -> int:
        """The host tier's blocks: 0 where it is off."""
        cache = self.config.cache
        if cache.num_host_kv_blocks or not cache.host_kv_cache_gb:
            return cache.num_host_kv_blocks
        block_bytes = kv_block_bytes(self.arch, cache.block_size, DTYPES[self.kv_cache_dtype])
        return max(1, int(cache.host_kv_cache_gb * 2**30) // block_bytes)

    def _context_limit(self) -> int:
        """The context asked for (the model's own unless set); more than the model's is refused."""
        limit = self.config.model.max_model_len or self.arch.max_position_embeddings
        if limit > self.arch.max_position_embeddings:
            raise ValueError(f"max_model_len {limit} exceeds the model's context "
                             f"({self.arch.max_position_embeddings} tokens)")
        return limit

    def _max_model_len(self) -> int:
        """The model's context, capped by the request, and by the pool so one request always fits."""
        return min(self._context_limit(), self.num_blocks * self.config.cache.block_size)

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None) -> Request:
        """Queue a request; raises ValueError for one that can never run, QueueFullError when full."""
        params = sampling_params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request = self._new_request(token_ids, params, request_id or f"request-{next(self.ids)}")
        self.scheduler.add_request(request)
        self.detokenizers[request.request_id] = self._detokenizer(token_ids, params)
        return request

    def add_prefill(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                    request_id: str) -> Request:
        """Prefill side of the cluster: compute the prompt, sample the first token, then keep the
        blocks until `export_kv` and `release_held`."""
        request = self.add_request(prompt_token_ids, sampling_params, request_id=request_id)
        request.hold_kv = True
        return request

    def export_kv(self, request_id: str, first_block: int = 0, stop_block: int | None = None) -> KVExport:
        """Copy blocks [first_block, stop_block) of a prefill's KV: of a running one (sent while the
        rest computes), or of a finished, held one, then with its first token."""
        held = self.scheduler.held.get(request_id)
        request = held or self.scheduler.requests[request_id]
        data = self.runner.read_blocks(self.kv_cache.block_ids(request_id)[first_block:stop_block])
        first_token_id = request.output_token_ids[0] if held is not None else None
        return KVExport(request_id, request.num_prompt_tokens, first_block, data, first_token_id)

    def computed_blocks(self, request_id: str) -> int:
        """Blocks of a running prefill whose KV is final: full ones, below the last prompt block (which
        always travels with the first token, so the last run is never empty)."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.finished:
            return 0
        block_size = self.config.cache.block_size
        last_block = (request.num_prompt_tokens - 1) // block_size
        return min(request.num_computed_tokens // block_size, last_block)

    def release_held(self, request_id: str) -> None:
        self.scheduler.release_held(request_id)

    def reserve_remote(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,
                       request_id: str, lease_s: float = 30.0) -> list[int] | None:
        """Decode side: reserve blocks for a prompt whose KV another worker computes; None if full."""
        request = self._new_request(list(prompt_token_ids), sampling_params, request_id)
        block_ids = self.scheduler.reserve_remote(request, lease_s)
        # The blocks it took may have held cached KV bound for the host tier: out before the KV lands.
        self.runner.copy_host_blocks(self.kv_cache.take_host_copies())
        if block_ids is not None:
            self.detokenizers[request_id] = self._detokenizer(request.prompt_token_ids, sampling_params)
        return block_ids

    def reserve_prompt(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams, *,  # noqa: PLR0913
                       request_id: str, lease_s: float = 30.0, reuse_prefix: bool = True,
                       local_prefill_below: int = 0) -> Reservation | None:
        """Decode side, reusing this engine's prefix cache: the prompt's leading blocks found cached are
        taken as they are, and only the rest is reserved for the prefill worker's KV. When fewer than
        `local_prefill_below` prompt tokens are not cached, the prompt is computed here instead (a
        prefill worker would ship more than it saves; 0: never). None if the blocks don't fit."""
        request = self._new_request(list(prompt_token_ids), sampling_params, request_id)
        cached = self.kv_cache.cached_prefix_blocks(request) if reuse_prefix else []
        num_reused = len(cached) * self.kv_cache.block_size
        # A request owed prompt logprobs computes its whole prompt wherever it runs: the prefill worker's.
        if request.num_prompt_tokens - num_reused < local_prefill_below and not request.num_prompt_logprobs_due:
            self.scheduler.add_request(request)  # its admission takes the cached blocks again
            self.detokenizers[request_id] = self._detokenizer(request.prompt_token_ids, sampling_params)
            self.num_local_prefills += 1
            self.num_reused_prompt_tokens += num_reused
            return Reservation([], len(cached), local=True)
        block_ids = self.scheduler.reserve_remote(request, lease_s, cached)
        if block_ids is None:
            return None
        self.detokenizers[request_id] = self._detokenizer(request.prompt_token_ids, sampling_params)
        self.num_reused_prompt_tokens += num_reused
        return Reservation(list(block_ids), len(cached))

    def import_kv(self, request_id: str, data: torch.Tensor) -> None:
        """Write received KV into the blocks reserved for `request_id`, after those it reused."""
        entry = self.scheduler.reserved.get(request_id)
        if entry is None:
            raise ValueError(f"no reservation for request {request_id!r}")
        self.runner.write_blocks(self.kv_cache.block_ids(request_id)[entry[0].num_reused_blocks:], data)

    def admit_remote(self, request_id: str, first_token_id: int) -> RequestOutput:
        """The KV is in place: the request joins the batch at the next step, after `first_token_id`."""
        request = self.scheduler.admit_remote(request_id, first_token_id)
        return self._output(request, [first_token_id], [])

    def fail_remote(self, request_id: str, first_token_id: int | None = None) -> RequestOutput | None:
        """The KV will not arrive: compute the prompt here; with the prefill's `first_token_id`, go
        on after it (`Scheduler.fail_remote`) and return its output, as `admit_remote` does."""
        request = self.scheduler.fail_remote(request_id, first_token_id)
        if request is None or first_token_id is None:
            return None
        return self._output(request, [first_token_id], [])

    def settle_remote(self, request_id: str, first_token_id: int | None) -> RequestOutput | None:
        """The router says which first token the client has (None: none); a request whose KV was
        lost is recomputed after it now (`Scheduler.settle`), with its output as `fail_remote`."""
        request = self.scheduler.settle(request_id, first_token_id)
        return self._news(request) if request is not None else None

    def kv_lost(self, request_id: str) -> RequestOutput | None:
        """The KV arrived broken: recompute after the first token the router said, or park the request
        until it says one (`Scheduler.kv_lost`); an output when there is news for the stream."""
        request = self.scheduler.kv_lost(request_id)
        return self._news(request) if request is not None else None

    # ---- prefixes fetched from peers (`cluster.engine.prefix_pins`) --------------------------------

    def _chain(self, prompt_token_ids: Sequence[int], cache_domain: str, num_blocks: int) -> list[int]:
        """The hashes of the prompt's first `num_blocks` blocks in `cache_domain`, as the prefix cache keys them."""
        size = self.kv_cache.block_size
        return prefix_hashes(list(prompt_token_ids[:num_blocks * size]), size, self.model_name, cache_domain)

    def offer_prefix(self, fetch_id: str, prompt_token_ids: Sequence[int], cache_domain: str,  # noqa: PLR0913
                     first_block: int, stop_block: int, lease_s: float = 30.0) -> int:
        """Donor side: pin the prompt's blocks [first_block, stop_block) this engine caches, up to the
        first it does not; how many (0: none). They stay until `export_offer` or `release_prefix`."""
        if not self.kv_cache.pool.enable_prefix_caching:
            return 0
        chain = self._chain(prompt_token_ids, cache_domain, stop_block)
        self._promote(chain[first_block:])
        return self.prefix_pins.offer(fetch_id, chain, first_block, lease_s)

    def _promote(self, chain: list[int]) -> None:
        """The host tier's blocks that continue the pool's run of `chain`, into the pool now (a peer
        reads them, or they lead a fetched prefix): a router's index lists both tiers' blocks."""
        if self.kv_cache.promote_run(chain):
            self.runner.copy_host_blocks(self.kv_cache.take_host_copies())

    def export_offer(self, fetch_id: str) -> torch.Tensor:
        """The offered blocks' KV, laid out as `export_kv`'s; the offer ends (its blocks unpinned)."""
        try:
            return self.runner.read_blocks(self.prefix_pins.take_offer(fetch_id))
        finally:
            self.prefix_pins.release(fetch_id, sent=True)

    def reserve_fetch(self, fetch_id: str, prompt_token_ids: Sequence[int], cache_domain: str,  # noqa: PLR0913
                      first_block: int, num_blocks: int, lease_s: float = 30.0) -> list[int] | None:
        """Fetcher side: blocks for the prompt's blocks [first_block, first_block + num_blocks) to land
        in, this engine's own cached blocks before them pinned; None when it does not hold those (or
        has no room). Once the KV is written (`land_fetch`) they are cached; `release_prefix` ends it."""
        if not self.kv_cache.pool.enable_prefix_caching:
            return None
        chain = self._chain(prompt_token_ids, cache_domain, first_block + num_blocks)
        if len(chain) < first_block + num_blocks:
            raise ValueError(f"the prompt has {len(chain)} full blocks, fewer than {first_block + num_blocks}")
        self._promote(chain[:first_block])
        block_ids = self.prefix_pins.reserve(fetch_id, chain, first_block, num_blocks, lease_s)
        # The blocks taken may have held cached KV bound for the host tier: out before the KV lands.
        self.runner.copy_host_blocks(self.kv_cache.take_host_copies())
        return block_ids

    def land_fetch(self, fetch_id: str, data: torch.Tensor) -> None:
        """Write a peer's KV into the blocks `reserve_fetch` took and cache them under their hashes."""
        self.runner.write_blocks([block.block_id for block in self.prefix_pins.pins[fetch_id].landing], data)
        self.prefix_pins.landed(fetch_id)

    def release_prefix(self, fetch_id: str) -> None:
        """End a fetch or an offer: its pinned blocks go back to the pool (cached ones stay cached)."""
        self.prefix_pins.release(fetch_id)

    def _news(self, request: Request) -> RequestOutput | None:
        """A decode-side request's output after its KV was given up: aborted (parked, unclaimed), or
        going on after the client's first token; None if there is nothing to tell yet."""
        if request.status == RequestStatus.FINISHED_ABORTED:
            return self.abort_output(request)
        if not request.output_token_ids:
            return None
        return self._output(request, [request.output_token_ids[0]], [])

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        """A resumed run's (`seed_offset` > 0) goes on after the output generated elsewhere, the last
        `seed_offset` prompt tokens, of which the client has `resumed_text`."""
        generated = len(prompt_token_ids) - params.seed_offset
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids[:generated], stop=params.stop,
                                             skip_special_tokens=params.skip_special_tokens,
                                             include_stop=params.include_stop_str_in_output)
        if params.seed_offset:
            detokenizer.resume(prompt_token_ids[generated:], params.resumed_text)
        return detokenizer

    def _new_request(self, token_ids: list[int], params: SamplingParams, request_id: str) -> Request:
        if not token_ids:
            raise ValueError("the prompt is empty")
        if params.priority != 0 and self.config.scheduler.policy != "priority":
            # As vLLM: a priority the scheduler would not honour is refused rather than ignored.
            raise ValueError(f"priority scheduling is not enabled (the scheduler's policy is "
                             f"{self.config.scheduler.policy!r}): priority must be 0, got {params.priority}")
        if max(token_ids) >= self.arch.vocab_size or min(token_ids) < 0:
            raise ValueError(f"prompt token ids must be in [0, {self.arch.vocab_size})")
        if params.seed_offset >= len(token_ids):  # a resumed run's generated tokens end its prompt
            raise ValueError(f"seed_offset {params.seed_offset} must be below the prompt's {len(token_ids)} tokens")
        if any(token >= self.arch.vocab_size for token, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.arch.vocab_size})")
        request = Request(request_id, token_ids, params, eos_token_ids=self.tokenizer.eos_token_ids,
                          priority=params.priority)
        self.scheduler.check_request_fits(request)
        if params.structured is not None:
            request.grammar = self._grammar_after(token_ids, params)
        return request

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """This model's grammar cache, built at the first constrained request (a few hundred ms). Loaded
        here: grammars need llguidance, and an engine that serves none runs without it."""
        from cluster.grammar.compiler import GrammarCompiler

        return GrammarCompiler.from_tokenizer(self.tokenizer, self.arch.vocab_size)

    def _grammar_after(self, token_ids: list[int], params: SamplingParams) -> GrammarMatcher:
        """A matcher for the request's grammar, past the output it generated already elsewhere (the
        last `seed_offset` prompt tokens of a resumed run); ValueError if they do not follow it."""
        assert params.structured is not None
        matcher = self.grammars.matcher(params.structured)
        for token_id in token_ids[len(token_ids) - params.seed_offset:]:
            if not matcher.accept(token_id):
                raise ValueError("the output generated before this resumed run does not follow its grammar")
        if matcher.finished:
            raise ValueError("the output generated before this resumed run already completes its grammar")
        return matcher

    def abort(self, request_id: str) -> bool:
        """End a request now, wherever it is; its blocks return to the pool at once."""
        return self.abort_request(request_id) is not None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """`abort`, returning the request's last output (finish reason "abort") for whoever streams
        it, or None if no such request was running."""
        request = self.scheduler.abort(request_id)
        if request is None:
            self._release(request_id)
            return None
        return self.abort_output(request)

    def abort_output(self, request: Request) -> RequestOutput:
        """The last output of an aborted request (finish reason "abort")."""
        request_id = request.request_id
        self._release(request_id)
        return RequestOutput(
            request_id=request_id, new_token_ids=[], new_text="", token_ids=request.output_token_ids,
            index=request.num_output_tokens, text="", finished=True, finish_reason=FinishReason.ABORT,
            num_prompt_tokens=request.num_prompt_tokens, num_cached_tokens=max(request.num_cached_tokens, 0),
            arrival_time=request.arrival_time, first_token_time=request.first_token_time)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.prefix_pins.pins:
            self.prefix_pins.expire()
        outputs = [output for request in self.scheduler.expire_reservations()
                   if (output := self._news(request)) is not None]
        scheduler_output = self.scheduler.schedule()
        self.last_step_tokens = scheduler_output.num_batched_tokens  # the worker's throughput counts them
        if scheduler_output.empty:
            return outputs
        runner_output = self.runner.execute(scheduler_output)
        self.scheduler.request_stats.step(scheduler_output.num_batched_tokens)
        for scheduled in scheduler_output.scheduled:  # before the update: a request may finish in it
            scheduled.request.prompt_logprobs += runner_output.prompt_logprobs.get(scheduled.request.request_id, [])
        before = [scheduled.request.num_output_tokens for scheduled in scheduler_output.scheduled]
        self.scheduler.update_from_output(scheduler_output, runner_output.sampled)
        for scheduled, num_before in zip(scheduler_output.scheduled, before, strict=True):
            request = scheduled.request
            token_ids = runner_output.sampled.get(request.request_id)
            if token_ids is None or request.status == RequestStatus.FINISHED_ABORTED:
                continue
            num_kept = request.num_output_tokens - num_before  # a stop condition inside them kept those up to it
            logprobs = runner_output.logprobs.get(request.request_id, [])[:num_kept]
            outputs.append(self._output(request, token_ids[:num_kept], logprobs))
        if self.proposer is not None:
            self._propose(scheduler_output)
        return outputs

    def _propose(self, scheduler_output: SchedulerOutput) -> None:
        """Drafts for the next step of each request this step advanced that decodes next: constrained
        requests are never given any (their grammar would have to follow every draft)."""
        assert self.proposer is not None
        requests, limits = [], []
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            request.draft_token_ids = []
            if request.finished or request.grammar is not None or \
                    request.num_computed_tokens + 1 != len(request.all_token_ids):
                continue
            requests.append(request)
            limits.append(self._max_drafts(request))
        for request, drafts in zip(requests, self.proposer.propose(requests, limits), strict=True):
            request.draft_token_ids = drafts

    def _max_drafts(self, request: Request) -> int:
        """Drafts worth running: positions inside the context, and no more than the tokens the request
        may still produce after the step's own one."""
        params = request.sampling_params
        return max(0, min(self.config.speculative.num_speculative_tokens,
                          self.max_model_len - len(request.all_token_ids),
                          params.max_tokens - request.num_output_tokens - 1))

    def _output(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprobs]) -> RequestOutput:
        """The output of `token_ids`, just appended to the request. A stop string found before the last
        of them ends the request there: the tokens after it are taken back."""
        detokenizer = self.detokenizers[request.request_id]
        new_text, num_kept = "", 0
        for token_id in token_ids:
            num_kept += 1
            # A prefill for another worker is not the request's end: text held back (a partial UTF-8
            # character, a possible stop string) is the decode worker's to release, not flushed here.
            final = request.finished and not request.hold_kv and num_kept == len(token_ids)
            new_text += detokenizer.add(token_id, final=final)
            if detokenizer.stopped:
                break
        if num_kept < len(token_ids):
            request.drop_output_tokens(len(token_ids) - num_kept)
            token_ids, logprobs = token_ids[:num_kept], logprobs[:num_kept]
            if request.finished:  # by a later token's condition: the stop string came first
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, detokenizer.stop_string
        if detokenizer.stopped and not request.finished:
            request.stop_reason = detokenizer.stop_string
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        request.logprobs += logprobs
        if request.finished:
            self._release(request.request_id)
        return RequestOutput(
            request_id=request.request_id, new_token_ids=token_ids, new_text=new_text,
            token_ids=request.output_token_ids, index=request.num_output_tokens - len(token_ids),
            text=detokenizer.text, finished=request.finished,
            finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0), new_logprobs=logprobs,
            stop_reason=request.stop_reason, arrival_time=request.arrival_time,
            first_token_time=request.first_token_time, prompt_logprobs=self._prompt_logprobs(request))

    @staticmethod
    def _prompt_logprobs(request: Request) -> list[TokenLogprobs | None] | None:
        """The prompt's logprobs, with the first output token only, once all are computed here (a
        decode worker that imported the prompt's KV has none: the prefill worker sent them)."""
        if request.num_output_tokens != 1 or request.sampling_params.prompt_logprobs is None:
            return None
        if len(request.prompt_logprobs) != request.num_prompt_tokens - 1:
            return None
        return [None, *request.prompt_logprobs]

    def _release(self, request_id: str) -> None:
        self.detokenizers.pop(request_id, None)
        self.runner.release(request_id)

    # ---- conveniences --------------------------------------------------------------------------

    def generate(self, prompts: Sequence[str | Sequence[int]], sampling_params: SamplingParams | None = None,
                 ) -> list[RequestOutput]:
        """Run prompts to completion; the final output of each, in order."""
        requests = [self.add_request(prompt, sampling_params) for prompt in prompts]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[request.request_id] for request in requests]

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def warm_up(self) -> float:
        """Run one short request through a prefill and a decode step, so that a broken device, backend
        or kernel fails here rather than on a client's request (on CUDA this compiles the Triton
        kernels), then capture the decode steps' CUDA graphs, before any request. Then time the prefill
        of a longer prompt (one step's budget, `WARM_UP_PROMPT_TOKENS` at most) and return its tokens
        per second: the router's estimate of this worker's throughput before it served anything, so
        that admission holds from the first burst on. Leaves no request, block, cached prefix or
        counter behind."""
        if self.has_unfinished_requests():
            raise RuntimeError("warm_up needs an idle engine")
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.engine.warm_up()
        self._warm_up_run([0])
        self.runner.capture_decode_graphs(self.config.scheduler.max_num_seqs)
        block_size = self.config.cache.block_size
        length = min(WARM_UP_PROMPT_TOKENS, self.config.scheduler.max_num_batched_tokens, self.max_model_len - 3,
                     (self.kv_cache.pool.num_blocks - 1) * block_size - 3)
        seconds = self._warm_up_run([0] * max(length, 1))
        return max(length, 1) / seconds if seconds > 0 else 0.0

    def _warm_up_run(self, prompt: list[int]) -> float:
        """One request to its end; the seconds of its first step (the prefill)."""
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)  # a prefill, then two decodes
        self.add_request(prompt, params, request_id=WARM_UP_REQUEST_ID)
        try:
            started = time.perf_counter()
            self.step()
            seconds = time.perf_counter() - started
            while self.has_unfinished_requests():
                self.step()
            return seconds
        except Exception:
            self.abort(WARM_UP_REQUEST_ID)  # a failed step leaves the request: its blocks go back
            raise
        finally:
            self.kv_cache.pool.reset_prefix_cache()
            self.kv_cache.prefix_queries = self.kv_cache.prefix_hits = 0
            if self.kv_cache.pool.host_tier is not None:
                self.kv_cache.pool.host_tier = HostTier(self.num_host_kv_blocks)  # its counters too
            self.scheduler.seconds_per_request = 0.0  # three tokens: not a client's request
            self.scheduler.request_stats = RequestStats(self.max_model_len)
            self.scheduler.spec_stats = SpecDecodeStats()

    def stats(self) -> EngineStats:
        pool = self.kv_cache.pool
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=pool.num_free_blocks, num_blocks=pool.num_blocks, kv_cache_usage=pool.usage,
            num_preemptions=self.scheduler.num_preemptions, prefix_cache_queries=self.kv_cache.prefix_queries,
            prefix_cache_hits=self.kv_cache.prefix_hits, num_recomputes=self.scheduler.num_recomputes,
            seconds_per_request=self.scheduler.seconds_per_request, num_swapped=len(self.scheduler.swapped),
            histograms=self.scheduler.request_stats.snapshot(),
            spec_decode=self.scheduler.spec_stats.copy() if self.proposer is not None else None,
            num_reused_prompt_tokens=self.num_reused_prompt_tokens, num_local_prefills=self.num_local_prefills,
            num_prefix_blocks_offered=self.prefix_pins.blocks_offered,
            num_prefix_blocks_fetched=self.prefix_pins.blocks_landed, host_kv=self._host_tier_stats())

    def _host_tier_stats(self) -> HostTierStats | None:
        tier = self.kv_cache.pool.host_tier
        if tier is None:
            return None
        return HostTierStats(tier.num_slots, tier.num_used, tier.queries, tier.hits, tier.offloaded, tier.promoted)
