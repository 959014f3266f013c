"""A worker: one engine driven by its own thread, plus the KV connector of its role.

The engine is not thread-safe, so everything that touches it runs on the engine thread: callers
on the asyncio side submit commands (`_call`) that the thread runs between steps, and outputs flow
back through one merging queue per request (`OutputStream`). The Ray actors of
`cluster.ray_cluster.worker_actor` wrap this class; tests drive it directly with the loopback connector.

Roles: "prefill" runs prompts and sends their KV (`prefill`), "decode" reserves blocks, receives
KV and streams the rest (`reserve`, `stream`), "colocated" does both phases itself (`generate`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import torch

from cluster.common.events import FinishReason, TokenEvent
from cluster.common.loads import (
    KV_TRANSFER_BUCKETS,
    KV_TRANSFER_EXPOSED,
    NO_REUSE,
    BucketCounts,
    KVTicket,
    PrefixReuse,
    TransferStats,
    WorkerLoad,
)
from cluster.common.roles import Role
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import SpeculativeConfig
from cluster.engine.llm_engine import EngineStats, KVExport, LLMEngine, RequestOutput
from cluster.observability.tracing import WorkerTraces
from cluster.state.interface import SharedState, WorkerInfo
from cluster.transfer.connector import KVHeader, KVReceiver, KVSender, TransferError
from cluster.worker.cpu_binding import bind_thread
from cluster.worker.kv_staging import landing_buffer, sends_device_memory, wire_bytes
from cluster.worker.node_cores import NodeCores
from cluster.worker.output_stream import OutputStream
from cluster.worker.own_thread import in_own_thread

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05
PUBLISH_S = 0.1  # how often the prefix cache's events go to the shared state
HEARTBEAT_TTL_S = 10.0
RECENT_TRANSFERS = 1024  # per-transfer stats kept (the totals count them all)
FETCH_WAIT_S = 5.0  # a prefill waits this long at most for a prefix fetched from a peer, then computes it


def event_of(output: RequestOutput, worker_id: str) -> TokenEvent:
    """The engine's output for one request and step, as it crosses process boundaries."""
    return TokenEvent(output.request_id, output.index, list(output.new_token_ids), output.new_text, output.finished,
                      output.finish_reason, output.num_prompt_tokens, worker_id, output.num_cached_tokens,
                      list(output.new_logprobs), output.prompt_logprobs)



def spec_decode_fields(stats: EngineStats, config: SpeculativeConfig) -> dict[str, Any]:
    """A worker load's speculative decoding counters, from its engine's; none where it does not speculate."""
    spec = stats.spec_decode
    if spec is None:
        return {}
    return {"num_speculative_tokens": config.num_speculative_tokens, "spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_decode_accepted_per_pos": list(spec.accepted_per_position)}

def host_kv_fields(stats: EngineStats) -> dict[str, Any]:
    """A worker load's host KV tier counters, from its engine's; none where it has no tier."""
    tier = stats.host_kv
    if tier is None:
        return {}
    return {"num_host_kv_blocks": tier.num_blocks, "host_kv_used_blocks": tier.num_used,
            "host_kv_queries": tier.queries, "host_kv_hits": tier.hits, "host_kv_offloaded": tier.offloaded,
            "host_kv_promoted": tier.promoted}


class Worker:
    """One engine on its own thread, in a role, with the KV connector of that role.

    Owns the engine, the engine thread (the only thread that touches the engine: commands queued by
    `_call` run between steps), the per-request output queues, the prefills whose KV is still being
    sent, and the transfer counters. Its public methods are coroutines called on the event loop
    that `start` ran on: by `WorkerActor` in a Ray actor, by `LocalService` in the serving process,
    and by the tests. It publishes its prefix cache and registry listing to the shared state, if given.
    """

    def __init__(self, worker_id: str, role: str, engine: LLMEngine, *, sender: KVSender | None = None,  # noqa: PLR0913
                 receiver: KVReceiver | None = None, overlap_transfer: bool = True,
                 state: SharedState | None = None, listing: WorkerInfo | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None, cores: NodeCores | None = None,
                 threads: int = 0, engine_cpus: frozenset[int] | None = None) -> None:
        if role not in tuple(Role):
            raise ValueError(f"role must be 'prefill', 'decode' or 'colocated', got {role!r}")
        self.worker_id, self.role, self.engine = worker_id, Role(role), engine
        self.sender, self.receiver = sender, receiver
        # The host's cores shared with the other workers on it: each step runs on as many threads as
        # cores no other busy worker holds (None: torch's own thread count, fixed).
        self.cores = cores
        self.claiming = False  # whether this worker holds a claim on cores now
        # The engine thread's torch threads (torch's thread count is per thread: another one's says nothing).
        self.threads = 0
        self.fixed_threads = threads  # > 0: the engine thread computes on these, whatever the load (no `cores`)
        # The cores the engine thread and its OpenMP threads run on, the front door's kept apart
        # (`cluster.worker.cpu_binding`); None: wherever the process may run.
        self.engine_cpus = engine_cpus
        # Send a prefill's blocks as they are computed (else all at once at its end: the baseline).
        self.overlap_transfer = overlap_transfer
        # Where this worker publishes the blocks its prefix cache stores and evicts (KV-aware routing).
        self.state = state
        # How routers find this worker in the shared registry (router replicas discover workers there).
        self.listing = listing or WorkerInfo(worker_id, role, worker_id)
        self.publisher: asyncio.Task[None] | None = None
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.streams: dict[str, OutputStream] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.stopped = False
        self.transfers: collections.deque[TransferStats] = collections.deque(maxlen=RECENT_TRANSFERS)
        # Since start, for the metrics: transfers sent, their bytes and seconds on the wire, failures.
        self.transfer_count, self.transfer_bytes, self.transfer_seconds, self.transfer_failures = 0, 0, 0.0, 0
        self.transfer_blocks = 0
        self.frame_count = 0
        self.transfer_exposed = BucketCounts(KV_TRANSFER_BUCKETS)  # each transfer's part after its prefill
        # Prefills whose KV goes out while they compute: runs of blocks queued by the engine thread,
        # sent by `prefill` on the event loop. request id -> (blocks queued so far, the queue).
        self.outboxes: dict[str, _Outbox] = {}
        # Why this worker cannot serve (its warm-up or engine thread failed); empty when it can.
        self.failure = ""
        # Called (on the engine thread) once the engine thread failed: a Ray actor ends its process
        # there, so that Ray restarts it and the routers resume its requests elsewhere.
        self.on_fatal = on_fatal
        self.pending: set[asyncio.Future[Any]] = set()  # `_call`s not answered yet
        self.tokens_per_s = 0.0  # recent throughput while busy (`_count_throughput`)
        self.rate_measured = False  # whether tokens_per_s comes from served steps (else warm-up's, or none)
        self.started_at = time.time()  # the engine (and its model) loaded just before
        self.broken = False  # the engine thread failed for good
        self.traces = WorkerTraces(worker_id)  # the spans of traced requests (empty while tracing is off)
        self.draining = False  # being removed: no new reservations, out of the registry (`drain`)
        # Reservations between their blocks and their `expect` (awaits on the way): aborted meanwhile?
        self.reserving: dict[str, bool] = {}
        # Prefixes fetched from peers (`expect_prefix`), by fetch id: whether their KV landed, once known.
        self.fetches: dict[str, asyncio.Future[bool]] = {}

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Warm the engine up (a short request through prefill and decode), then start serving. A
        failed warm-up does not raise: the worker reports `failure`, and the service stays unready."""
        self.loop = asyncio.get_running_loop()
        log.info("%s: the model runs on %s in %s (%s), its KV cache in %s", self.worker_id, self.engine.device,
                 self.engine.dtype, self.engine.dtype_reason, self.engine.kv_cache_dtype)
        try:
            # Its prefill rate: what the routers admit prompts by until real steps have been timed.
            # On a thread that ends: its OpenMP team must not outlive it (`cluster.worker.own_thread`).
            self.tokens_per_s = await asyncio.to_thread(in_own_thread, self._warm_up)  # until the first timed step
        except Exception as error:
            self.failure = f"warm-up failed on {self.engine.device}: {error!r}"
            log.error("%s: %s", self.worker_id, self.failure)
        if self._direct(self.sender) or self._direct(self.receiver):
            # UCX's CUDA copies run on this (the event loop's) thread: it needs the device's context.
            torch.cuda.set_device(self.engine.device)
        for connector in (self.sender, self.receiver):
            if connector is not None and self.engine.device.type == "cuda":
                log.info("%s: KV %s %s", self.worker_id, "leaves" if connector is self.sender else "lands",
                         "straight from and into GPU memory" if self._direct(connector)
                         else "through pinned host memory")
        if self.sender is not None:
            await self.sender.start()
        if self.receiver is not None:
            await self.receiver.start()
            log.info("%s listens for KV at %s", self.worker_id, self.receiver.address)
            if self.role != Role.PREFILL:  # a prefill worker's receiver takes fetched prefixes only
                await self._prefault_landing()
        self.thread = threading.Thread(target=self._run, name=f"engine-{self.worker_id}", daemon=True)
        self.thread.start()
        if self.state is not None:
            # Every role's prefix cache steers the routers: prefill workers' by the prompt work they
            # save, decode workers' by the blocks a conversation's next turn need not ship.
            self.engine.kv_cache.pool.record_events()
            self.publisher = asyncio.create_task(self._publish())

    async def _prefault_landing(self) -> None:
        """Make the landing memory of prompts up to one prefill step's tokens now (shared memory, off the
        loop): the first reservations then take pooled segments instead of waiting for new ones."""
        assert self.receiver is not None
        if self.engine.runner.device.type != "cpu":
            return  # GPU KV lands in device or pinned memory, never in a segment
        tokens = min(self.engine.config.scheduler.max_num_batched_tokens, self.engine.max_model_len)
        shape = self._landing_shape(-(-tokens // self.engine.config.cache.block_size))
        made = await self.receiver.prefault_landing_up_to(math.prod(shape) * self.engine.runner.kv_dtype.itemsize)
        log.info("%s: %d KV landing segments made ahead, for prompts of up to %d tokens", self.worker_id, made, tokens)

    def _landing_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The staging buffer's shape for `num_blocks` blocks of a prompt's KV: [blocks, layers, 2, block...]."""
        return self.engine.runner.kv_blocks_shape(num_blocks)

    async def _publish(self) -> None:
        """Keep this worker listed in the shared registry (a heartbeat), and every PUBLISH_S send the
        prefix cache's stored and evicted block hashes. Whenever the index may have missed events
        (Redis restarted empty, or calls fell back while it was away) send the whole cache again."""
        assert self.state is not None
        await self.state.register(self.listing, HEARTBEAT_TTL_S)
        await self.state.forget_worker(self.worker_id)  # a restarted worker's cache starts empty
        beat, fallbacks = time.monotonic(), self._state_fallbacks()
        while not self.stopped:
            await asyncio.sleep(PUBLISH_S)
            resync = self._state_fallbacks() != fallbacks
            if time.monotonic() - beat > HEARTBEAT_TTL_S / 3:
                beat = time.monotonic()
                if not await self.state.heartbeat(self.worker_id, HEARTBEAT_TTL_S):
                    await self.state.register(self.listing, HEARTBEAT_TTL_S)
                    resync = True
            if resync and getattr(self.state, "healthy", True):
                fallbacks = self._state_fallbacks()
                await self._publish_cache()
                continue
            events = await self._call(self.engine.kv_cache.pool.take_events)
            if events.stored or events.evicted:
                await self.state.publish_blocks(self.worker_id, events.stored, events.evicted)

    async def _publish_cache(self) -> None:
        """Replace this worker's entry in the prefix index by every block its caches hold now (the
        host tier's too: a prefix there is served from there)."""
        assert self.state is not None
        pool = self.engine.kv_cache.pool

        def cached_now() -> list[int]:
            pool.take_events()  # what they would add is in the snapshot already
            return pool.held_hashes()

        snapshot = await self._call(cached_now)
        await self.state.forget_worker(self.worker_id)
        if snapshot:
            await self.state.publish_blocks(self.worker_id, snapshot, [])
        log.info("%s: published its whole prefix cache again (%d blocks)", self.worker_id, len(snapshot))

    def _state_fallbacks(self) -> int:
        """Calls to the shared state answered by a fallback since start (each may have lost events)."""
        return sum(getattr(self.state, "fallbacks", {}).values())

    async def stop(self) -> None:
        if self.publisher is not None:
            self.publisher.cancel()
        if self.state is not None:  # routers stop seeing it now, not when its registration expires
            await self.state.deregister(self.worker_id)
            await self.state.close()
        self.stopped = True
        self.wake.set()
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, 10)
        if self.thread is None or not self.thread.is_alive():  # never under a step still running
            self.engine.close()
        if self.cores is not None:
            self.cores.idle()
        for connector in (self.sender, self.receiver):
            if connector is not None:
                await connector.close()

    async def drain(self, timeout_s: float) -> bool:
        """Take no new requests and wait, `timeout_s` at most, until those it holds have ended (no
        stream open, nothing in the engine). True when it emptied in time; then its blocks are all
        free. It leaves the registry at once, so routers of other gateways stop finding it, and says
        `draining` in its load, so those that know it stop ranking it. The caller (the scaler) stops
        it afterwards; requests still here past the timeout are the routers' to resume elsewhere."""
        self.draining = True
        if self.publisher is not None:
            self.publisher.cancel()  # its heartbeat would list it again
        if self.state is not None:
            await self.state.deregister(self.worker_id)
        deadline = time.monotonic() + timeout_s
        while self.streams or await self._holds_requests():
            if time.monotonic() >= deadline:
                log.warning("%s: %d requests still here after draining %.0f s", self.worker_id, len(self.streams),
                            timeout_s)
                return False
            await asyncio.sleep(IDLE_WAIT_S)
        log.info("%s: drained", self.worker_id)
        return True

    async def _holds_requests(self) -> bool:
        stats = await self._call(self.engine.stats)
        return bool(stats.num_running or stats.num_waiting)

    def _direct(self, connector: KVSender | KVReceiver | None) -> bool:
        """Whether KV through `connector` stays in device memory (see `kv_staging`)."""
        return connector is not None and sends_device_memory(self.engine.device,
                                                             connector.carries_device_memory)

    def _run(self) -> None:
        """The engine thread. A step that raises fails its requests and the thread goes on; anything
        else that raises here (a command, a KV import, an export) leaves the engine in a state no
        one knows: the worker fails for good, loudly (`_fail_for_good`), instead of living on with a
        dead thread while every call to it hangs."""
        try:
            self._serve()
        except BaseException as error:
            self._fail_for_good(error)

    def _fail_for_good(self, error: BaseException) -> None:
        self.broken = True  # before `_fail_pending` is scheduled: a `_call` after it refuses itself
        self.failure = f"the engine thread failed: {error!r}"
        log.critical("%s: %s; it serves no more", self.worker_id, self.failure, exc_info=error)
        if self.on_fatal is not None:  # first: a Ray worker's process ends here, its callers see it die
            self.on_fatal(error)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._fail_pending, error)
        for request_id in list(self.streams):
            self._deliver(request_id, error)

    def _fail_pending(self, error: BaseException) -> None:
        for future in list(self.pending):
            _set_exception(future, RuntimeError(f"{self.worker_id}: {self.failure}"))

    def _warm_up(self) -> float:
        self._place_engine_thread()
        return self.engine.warm_up()

    def _place_engine_thread(self) -> None:
        """The calling thread's cores and torch threads (both per thread), before its first op: the
        OpenMP threads its first parallel op starts take its cores."""
        if self.engine_cpus:
            bind_thread(self.engine_cpus)
        # Bound, and no `cores` to follow: one thread per core it may use (torch's default counts them all).
        threads = self.fixed_threads or (len(self.engine_cpus) if self.engine_cpus and self.cores is None else 0)
        if threads:
            torch.set_num_threads(threads)

    def _serve(self) -> None:
        self._place_engine_thread()
        self.threads = torch.get_num_threads()
        while not self.stopped:
            while not self.commands.empty():
                self.commands.get()()
            if self.engine.has_unfinished_requests():
                if self.cores is not None and self._has_compute():
                    self.threads = self.cores.busy()
                    self.claiming = True
                started = time.perf_counter()
                try:
                    outputs = self.engine.step()
                    self.traces.after_step(self.engine.scheduler.requests, time.perf_counter() - started)
                    self._count_throughput(self.engine.last_step_tokens, time.perf_counter() - started)
                except Exception as error:  # a broken step must not hang every caller
                    log.exception("engine step failed on %s", self.worker_id)
                    self._fail_all(error)
                    continue
                for output in outputs:
                    if output.finished and output.request_id in self.engine.scheduler.held:
                        self._export(output.request_id)
                self._deliver_step(outputs)
                self._stop_expecting([output.request_id for output in outputs if output.finished])
                if self.overlap_transfer:
                    self._export_computed_blocks()
            if not self.engine.has_unfinished_requests() or not self.engine.scheduler.running:
                if self.claiming:  # nothing to compute until woken: the cores go to whoever has work
                    self.cores.idle()  # type: ignore[union-attr]
                    self.claiming = False
                self.wake.wait(IDLE_WAIT_S)
                self.wake.clear()

    def _stop_expecting(self, request_ids: list[str]) -> None:
        """Requests that ended here: the receiver lets go of what it still holds for their KV (after
        a lease that ended, the KV may never come: an expect and its shared-memory segment would stay)."""
        if request_ids and self.receiver is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(_cancel_each, self.receiver, request_ids)

    def _has_compute(self) -> bool:
        """Whether the next step computes anything: requests running or waiting, or KV that landed. A
        decode worker holding only reservations (KV on its way) steps to expire leases, no more."""
        scheduler = self.engine.scheduler
        return bool(scheduler.running or scheduler.waiting or scheduler.remote_ready)

    def _count_throughput(self, tokens: int, seconds: float) -> None:
        """Tokens per second of busy step time, averaged over recent steps: what the router sizes a
        prefill worker's queue by (seconds of work ahead of a new prompt)."""
        if tokens > 0 and seconds > 0:
            rate = tokens / seconds
            self.tokens_per_s = 0.8 * self.tokens_per_s + 0.2 * rate if self.rate_measured else rate
            self.rate_measured = True

    def _export_computed_blocks(self) -> None:
        """Queue the blocks each running prefill finished this step, so they travel while the rest
        of its prompt computes (the overlap of transfer and compute)."""
        for request_id, outbox in list(self.outboxes.items()):
            computed = self.engine.computed_blocks(request_id)
            if computed > outbox.queued:
                self._post(outbox, self.engine.export_kv(request_id, outbox.queued, computed))

    def _export(self, request_id: str) -> None:
        """Queue a finished prefill's last blocks (with its first token) and free its blocks right
        after the step that finished it: waiting for the asyncio side would hold them through the
        next (maybe long) step."""
        outbox = self.outboxes.get(request_id)
        if outbox is not None:
            self._post(outbox, self.engine.export_kv(request_id, outbox.queued))
        self.engine.release_held(request_id)

    def _post(self, outbox: _Outbox, export: KVExport) -> None:
        outbox.queued = export.first_block + export.data.shape[0]
        if self.loop is not None:
            self.loop.call_soon_threadsafe(outbox.runs.put_nowait, export)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self.streams.get(request_id)
        if stream is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(stream.put, item)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs handed to the event loop at once: one wake-up of the loop, not one per
        request, and every stream of the step readied together (so a channel carries the step in one
        message, `cluster.ray_cluster.channels`)."""
        ready = [(stream, output) for output in outputs if (stream := self.streams.get(output.request_id)) is not None]
        if ready and self.loop is not None:
            self.loop.call_soon_threadsafe(_put_each, ready)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self.streams):
            self.engine.abort(request_id)
            self._deliver(request_id, error)

    async def _call(self, function: Callable[[], T]) -> T:
        """Run `function` on the engine thread between steps; its result or exception comes back."""
        assert self.loop is not None, "start() the worker first"
        if self.broken:
            raise RuntimeError(f"{self.worker_id}: {self.failure}")
        future: asyncio.Future[T] = self.loop.create_future()
        self.pending.add(future)
        future.add_done_callback(self.pending.discard)

        def run() -> None:
            try:
                result = function()
            except BaseException as error:
                self.loop.call_soon_threadsafe(_set_exception, future, error)  # type: ignore[union-attr]
            else:
                self.loop.call_soon_threadsafe(_set_result, future, result)  # type: ignore[union-attr]

        self.commands.put(run)
        self.wake.set()
        return await future

    # ---- every role ----------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, trace: str = "") -> AsyncIterator[RequestOutput]:
        """Run a request here from prompt to end (colocated), yielding each step's output. `trace`:
        the caller's W3C traceparent, if the request is traced."""
        self._claim(request_id)
        self.streams[request_id] = OutputStream()
        self.traces.begin(request_id, trace, "pdserve.generate", len(prompt_token_ids), watch_prompt=True)
        try:
            await self._call(lambda: self.engine.add_request(prompt_token_ids, params, request_id=request_id))
            async for output in self._outputs(request_id):
                yield output
        finally:
            self.traces.finish(request_id)
            await self._close_stream(request_id)

    async def abort(self, request_id: str) -> bool:
        """End the request here (blocks freed at once); whoever streams it gets a last output with
        finish reason "abort" instead of waiting forever."""
        if self.receiver is not None:
            self.receiver.cancel(request_id)
        if request_id in self.reserving:  # `reserve` is on its way to expecting the KV: it cancels that
            self.reserving[request_id] = True
        self.traces.finish(request_id)

        def end() -> bool:
            output = self.engine.abort_request(request_id)
            if output is not None:
                self._deliver(request_id, output)
            return output is not None

        return await self._call(end)

    async def load(self) -> WorkerLoad:
        stats = await self._call(self.engine.stats)
        return WorkerLoad(self.worker_id, self.role, stats.num_running, stats.num_waiting, stats.num_free_blocks,
                          stats.num_blocks, stats.kv_cache_usage, stats.num_preemptions, stats.prefix_cache_queries,
                          stats.prefix_cache_hits, self.transfer_count, self.transfer_bytes, self.transfer_seconds,
                          self.transfer_failures, self.frame_count, stats.num_recomputes, str(self.engine.device),
                          self.failure, self.tokens_per_s, stats.seconds_per_request,
                          self.engine.config.scheduler.max_num_seqs, self.started_at,
                          {**stats.histograms, KV_TRANSFER_EXPOSED: replace(self.transfer_exposed,
                                                                            counts=list(self.transfer_exposed.counts))},
                          stats.num_swapped, self.engine.config.scheduler.preemption_mode == "swap",
                          {key: str(value) for key, value in asdict(self.engine.config.cache).items()},
                          dtype=self.engine.dtype, kv_cache_dtype=self.engine.kv_cache_dtype, threads=self.threads,
                          num_held=len(self.streams),
                          draining=self.draining, kv_transfer_blocks=self.transfer_blocks,
                          decode_reused_prompt_tokens=stats.num_reused_prompt_tokens,
                          local_prefills=stats.num_local_prefills,
                          prefix_blocks_fetched=stats.num_prefix_blocks_fetched,
                          prefix_blocks_offered=stats.num_prefix_blocks_offered,
                          **spec_decode_fields(stats, self.engine.config.speculative), **host_kv_fields(stats))

    def _claim(self, request_id: str) -> None:
        """Refuse an id already streaming here: its stream (and its abort on exit) would be the other's."""
        if request_id in self.streams:
            raise ValueError(f"request id {request_id!r} is already in use on {self.worker_id}")

    async def _outputs(self, request_id: str) -> AsyncIterator[RequestOutput]:
        stream = self.streams[request_id]
        while True:
            item = await stream.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def _close_stream(self, request_id: str) -> None:
        """Called when a consumer stops listening: a request still running is aborted, so a client
        that went away frees its blocks within a step."""
        self.streams.pop(request_id, None)
        if not self.stopped:
            await self._call(lambda: self.engine.abort(request_id))

    # ---- prefill role --------------------------------------------------------------------------

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,  # noqa: PLR0913
                      ticket: KVTicket, trace: str = "", fetch_id: str = "") -> AsyncIterator[
                          RequestOutput | TransferStats]:
        """Compute the prompt, sending its KV to the decode worker's `ticket` chunk by chunk as it computes;
        yield the first token at once, then the transfer's stats once the last block landed. `fetch_id`:
        a prefix of the prompt fetched from a peer (`expect_prefix`), awaited first and released after.

        A failed send raises TransferError (the decode worker then recomputes) and stops the
        prefill; the blocks are released whatever happens.
        """
        assert self.sender is not None, "a prefill worker needs a KV sender"
        # The first token as one engine would sample it (penalties over the prompt, min_tokens masking,
        # the seed's stream after `seed_offset`), and nothing after it.
        first_params = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), ignore_eos=True)
        self._claim(request_id)
        stream = OutputStream()
        self.streams[request_id] = stream
        # The decode worker holds the prompt's first `reused_blocks` blocks already: they stay here.
        outbox = self.outboxes[request_id] = _Outbox(queued=ticket.reused_blocks)
        sending: asyncio.Task[TransferStats] | None = None
        self.traces.begin(request_id, trace, "pdserve.prefill", len(prompt_token_ids), watch_prompt=True)
        try:
            if fetch_id:
                await self._await_prefix(fetch_id)
            await self._call(lambda: self.engine.add_prefill(prompt_token_ids, first_params, request_id=request_id))
            sending = asyncio.create_task(self._send_runs(request_id, ticket, outbox))
            # A send that fails mid-prompt ends the prefill at once, not after the prompt computed.
            sending.add_done_callback(lambda task: _raise_into(stream, task))
            async for output in self._outputs(request_id):
                yield output
            if output.finish_reason == FinishReason.ABORT:
                return  # aborted here: no last frame will come
            yield await sending
        finally:
            self.traces.finish(request_id)
            self.streams.pop(request_id, None)
            self.outboxes.pop(request_id, None)
            if sending is not None and not sending.done():
                sending.cancel()
            await self._call(lambda: self.engine.abort(request_id))  # a prefill cut short frees its blocks
            if fetch_id:  # the prompt holds the fetched blocks itself now, or never will
                await self.release_prefix(fetch_id)

    async def _send_runs(self, request_id: str, ticket: KVTicket, outbox: _Outbox) -> TransferStats:
        """Send the runs of blocks the engine thread queues, in order, until the last one."""
        assert self.sender is not None
        stats = TransferStats(request_id, 0, 0.0, frames=0)
        while True:
            export = await outbox.runs.get()
            data = export.data if not ticket.dtype else export.data.to(getattr(torch, ticket.dtype))  # same: no copy
            # Numbered from the first block the receiver lacks: the transfer holds the prompt's tokens from there.
            skipped = ticket.reused_blocks
            header = _frame_header(request_id, data, export.num_tokens - skipped * data.shape[3], ticket.token,
                                   first_block=export.first_block - skipped, last=export.last,
                                   first_token_id=export.first_token_id or 0)
            transport = self.sender.transport_to(ticket.address, ticket.landing)
            started = time.perf_counter()
            try:
                with self.traces.kv_send(request_id, header, transport) as header:
                    stats.transport = await self.sender.send(ticket.address, header,
                                                             wire_bytes(data, self._direct(self.sender)),
                                                             landing=ticket.landing) \
                        or _transport_of(self.sender)
            except Exception as error:
                self.transfer_failures += 1
                log.warning("%s (%s): KV of %s to %s failed (%s)", self.worker_id,
                            self.listing.meta.get("host", "this host"), request_id, ticket.address, error)
                raise
            seconds = time.perf_counter() - started
            self.frame_count += 1
            stats.nbytes, stats.seconds, stats.frames = stats.nbytes + header.nbytes, stats.seconds + seconds, \
                stats.frames + 1
            self.transfer_blocks += header.num_blocks
            if export.last:
                stats.exposed_s = seconds
                self.transfer_exposed.observe(seconds)
                self.transfers.append(stats)
                self.transfer_count += 1
                self.transfer_bytes += stats.nbytes
                self.transfer_seconds += stats.seconds
                return stats

    # ---- prefixes fetched from peers (`cluster.engine.prefix_pins`) ------------------------------

    async def offer_prefix(self, fetch_id: str, prompt_token_ids: list[int], cache_domain: str,  # noqa: PLR0913
                           first_block: int, stop_block: int, lease_s: float = 30.0) -> int:
        """Donor side (any worker with a KV sender): pin the prompt's blocks [first_block, stop_block)
        this worker caches, up to the first it lacks, for `send_prefix`; how many (0: none)."""
        if self.sender is None:
            return 0
        return await self._call(lambda: self.engine.offer_prefix(fetch_id, prompt_token_ids, cache_domain,
                                                                 first_block, stop_block, lease_s))

    async def send_prefix(self, fetch_id: str, ticket: KVTicket) -> TransferStats:
        """Send the blocks `offer_prefix` pinned to the fetcher's `ticket` in one frame; the offer ends
        whatever happens. Raises TransferError (the fetcher then computes the prefix itself)."""
        assert self.sender is not None, "a donor needs a KV sender"
        try:
            data = await self._call(lambda: self.engine.export_offer(fetch_id))
        except KeyError:
            raise TransferError(f"{self.worker_id}: the offer {fetch_id!r} ended (its lease ran out)") from None
        data = data if not ticket.dtype else data.to(getattr(torch, ticket.dtype))
        header = _frame_header(fetch_id, data, data.shape[0] * data.shape[3], ticket.token)
        started = time.perf_counter()
        transport = await self.sender.send(ticket.address, header, wire_bytes(data, self._direct(self.sender)),
                                           landing=ticket.landing)
        return TransferStats(fetch_id, header.nbytes, time.perf_counter() - started,
                             transport=transport or _transport_of(self.sender))

    async def expect_prefix(self, fetch_id: str, prompt_token_ids: list[int], cache_domain: str,  # noqa: PLR0913
                            first_block: int, num_blocks: int, lease_s: float = 30.0) -> KVTicket | None:
        """Fetcher side (a prefill worker with a KV receiver): blocks for a peer's KV of the prompt's
        blocks [first_block, first_block + num_blocks), and the ticket the peer sends them with; None
        when this worker cannot take them (no receiver, it lacks the blocks before them, no room).
        The blocks are cached once the KV lands; `prefill(..., fetch_id=)` waits for that."""
        if self.receiver is None or self.draining:
            return None
        block_ids = await self._call(lambda: self.engine.reserve_fetch(fetch_id, prompt_token_ids, cache_domain,
                                                                       first_block, num_blocks, lease_s))
        if block_ids is None:
            return None
        ticket, staging, arrived = await self._expect_blocks(fetch_id, num_blocks)
        landed = self.fetches[fetch_id] = asyncio.get_running_loop().create_future()
        arrived.add_done_callback(lambda future: asyncio.ensure_future(self._land_prefix(fetch_id, future, staging,
                                                                                         landed)))
        return ticket

    async def _land_prefix(self, fetch_id: str, arrived: asyncio.Future[KVHeader], staging: torch.Tensor,
                           landed: asyncio.Future[bool]) -> None:
        """Write a fetched prefix into its blocks and cache them (on the engine thread); `landed` says
        whether it did. A failed or cancelled transfer lands nothing: the prompt computes the prefix."""
        ok = not arrived.cancelled() and arrived.exception() is None

        def land() -> bool:
            if not ok or fetch_id not in self.engine.prefix_pins.pins:  # failed, released or expired meanwhile
                return False
            self.engine.land_fetch(fetch_id, staging)
            return True

        try:
            _set_result(landed, await self._call(land))
        except Exception as error:
            log.warning("%s: the prefix %s fetched could not be landed (%r)", self.worker_id, fetch_id, error)
            _set_result(landed, False)

    async def _await_prefix(self, fetch_id: str) -> None:
        """Wait (FETCH_WAIT_S at most) for a fetched prefix to be in place before the prompt looks up its cache."""
        landed = self.fetches.get(fetch_id)
        if landed is None:
            return
        try:
            if not await asyncio.wait_for(asyncio.shield(landed), FETCH_WAIT_S):
                log.warning("%s: the prefix %s did not arrive: computing it", self.worker_id, fetch_id)
        except TimeoutError:
            log.warning("%s: the prefix %s took over %.0f s: computing it", self.worker_id, fetch_id, FETCH_WAIT_S)

    async def release_prefix(self, fetch_id: str) -> None:
        """End a fetch or an offer here (its transfer stops, its blocks go back; cached ones stay
        cached): whatever happened to it, nothing of it stays. Nothing if it is gone already."""
        if self.receiver is not None:
            self.receiver.cancel(fetch_id)
        landed = self.fetches.pop(fetch_id, None)
        if landed is not None:
            _set_result(landed, False)
        await self._call(lambda: self.engine.release_prefix(fetch_id))

    # ---- decode role ---------------------------------------------------------------------------

    async def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,  # noqa: PLR0913
                      lease_s: float = 30.0, trace: str = "", reuse: PrefixReuse = NO_REUSE) -> KVTicket | None:
        """Reserve blocks for the prompt and await its KV; the ticket a prefill worker sends it with (the
        receiver's address, a one-time token, the leading blocks this worker holds already), or None if
        full. With `reuse` the prompt's cached beginning is taken from this worker's prefix cache, and
        a short enough rest is computed here at once (the ticket says `local`: nothing is to be sent).

        When the KV lands it is written into the blocks and the request joins the batch; when the
        transfer fails or the lease ends first, the prompt is computed here instead.
        """
        assert self.receiver is not None, "a decode worker needs a KV receiver"
        if self.draining:  # the router asks the next one
            return None
        self._claim(request_id)
        self.streams[request_id] = OutputStream()
        self.traces.begin(request_id, trace, "pdserve.decode_admission")
        self.reserving[request_id] = False
        try:
            ticket = await self._reserve(request_id, prompt_token_ids, params, lease_s, reuse)
        finally:
            aborted = self.reserving.pop(request_id, False)
        if ticket is not None and aborted:  # while the blocks or the landing buffer were on their way
            self.receiver.cancel(request_id)  # the abort freed the blocks; the buffer goes back now
        return ticket

    async def _reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       lease_s: float, reuse: PrefixReuse) -> KVTicket | None:
        assert self.receiver is not None
        try:
            reservation = await self._call(lambda: self.engine.reserve_prompt(
                prompt_token_ids, params, request_id=request_id, lease_s=lease_s, reuse_prefix=reuse.enabled,
                local_prefill_below=reuse.local_prefill_threshold if reuse.enabled else 0))
        except BaseException as error:  # refused (a prompt the model cannot take): nothing of it stays here
            self.streams.pop(request_id, None)
            self.traces.finish(request_id, error)
            raise
        if reservation is None:
            self.streams.pop(request_id, None)
            self.traces.finish(request_id)
            return None
        if reservation.local:
            self.traces.end(request_id, "pdserve.decode_admission", outcome="local")
            return KVTicket(self.receiver.address, "", reused_blocks=reservation.num_reused_blocks, local=True)
        ticket, staging, arrived = await self._expect_blocks(request_id, reservation.num_to_receive,
                                                             reservation.num_reused_blocks)
        arrived.add_done_callback(lambda future: self._on_kv(request_id, future, staging))
        return ticket

    async def _expect_blocks(self, transfer_id: str, num_blocks: int, reused_blocks: int = 0) -> tuple[
            KVTicket, torch.Tensor, asyncio.Future[KVHeader]]:
        """A landing buffer for `num_blocks` blocks of KV, expected by the receiver under `transfer_id`:
        the ticket a sender sends them with, the buffer, and the future that resolves once they landed."""
        assert self.receiver is not None
        runner = self.engine.runner
        direct = self._direct(self.receiver)
        ticket = KVTicket(self.receiver.address, secrets.token_hex(16), self.engine.kv_cache_dtype,
                          reused_blocks=reused_blocks)
        shape = self._landing_shape(num_blocks)
        # Awaited: a new shared-memory segment is faulted in on a thread, not on this loop.
        shared = await self.receiver.landing_memory(ticket.token, math.prod(shape) * runner.kv_dtype.itemsize) \
            if runner.device.type == "cpu" else None
        staging = landing_buffer(shape, runner.kv_dtype, runner.device, direct, lambda nbytes: shared)
        arrived = self.receiver.expect(transfer_id, wire_bytes(staging, direct), ticket.token)
        if shared is not None:  # the sender finds the segment by this name, never by the token
            ticket = replace(ticket, landing=self.receiver.landing_name(ticket.token))
        return ticket, staging, arrived

    def _on_kv(self, request_id: str, future: asyncio.Future[KVHeader], staging: torch.Tensor) -> None:
        if future.cancelled():
            return  # aborted: the abort freed the blocks
        error = future.exception()
        first_token_id = future.result().first_token_id if error is None else -1
        if error is None and not 0 <= first_token_id < self.engine.arch.vocab_size:
            error = TransferError(f"first token id {first_token_id} is outside the vocabulary")  # a sender's bug
        if error is None:
            self.traces.kv_landed(request_id, future.result(), staging.nbytes)

        def land() -> None:
            if request_id not in self.engine.scheduler.reserved:
                return  # aborted or expired meanwhile
            if error is not None:
                log.warning("%s: KV for %s did not arrive at %s (%s): recomputing here", self.worker_id, request_id,
                            self.receiver.address if self.receiver else "", error)
                output = self.engine.kv_lost(request_id)
                if output is not None:
                    self._deliver(request_id, output)
                self.traces.end(request_id, "pdserve.decode_admission", outcome="recomputed")
                return
            self.engine.import_kv(request_id, staging)
            self.traces.end(request_id, "pdserve.kv_receive")
            self._deliver(request_id, self.engine.admit_remote(request_id, first_token_id))
            self.traces.end(request_id, "pdserve.decode_admission", outcome="kv")

        self.commands.put(land)
        self.wake.set()

    async def recompute(self, request_id: str, first_token_id: int | None = None) -> None:
        """The sender reported the transfer failed: stop waiting for it, compute the prompt here.
        `first_token_id`: the prefill's first token, which the client already has: the request goes
        on after it (never a first token of this worker's own spliced after it)."""
        assert self.receiver is not None
        self.receiver.cancel(request_id)
        self.traces.end(request_id, "pdserve.decode_admission", outcome="recomputed")

        def fail() -> None:
            output = self.engine.fail_remote(request_id, first_token_id)
            if output is not None:
                self._deliver(request_id, output)

        await self._call(fail)

    async def stream(self, request_id: str, first_token_id: int | None = None,
                     trace: str = "") -> AsyncIterator[RequestOutput]:
        """Outputs of a reserved request as they are produced, starting with the first token (the
        prefill's, or this worker's own when it had to recompute the prompt). `first_token_id`: the
        one the client has from the prefill (None: none), so that a KV lost now or later (lease
        ended, arrived broken) is recomputed after it, never after a first token of this worker's."""
        if request_id not in self.streams:
            raise KeyError(f"no request {request_id!r} on {self.worker_id}")

        def settle() -> None:
            output = self.engine.settle_remote(request_id, first_token_id)
            if output is not None:
                self._deliver(request_id, output)

        self.traces.begin(request_id, trace, "pdserve.decode_stream")
        try:
            await self._call(settle)
            async for output in self._outputs(request_id):
                yield output
            self.traces.end(request_id, "pdserve.decode_stream", output_tokens=output.index + len(output.new_token_ids),
                            finish_reason=output.finish_reason)
        finally:
            self.traces.finish(request_id)
            await self._close_stream(request_id)


@dataclass(slots=True)
class _Outbox:
    """A prefill's runs of KV blocks on their way from the engine thread to the sending task."""

    queued: int = 0  # blocks handed to `runs` so far
    runs: asyncio.Queue[KVExport] = field(default_factory=asyncio.Queue)


def _frame_header(request_id: str, data: torch.Tensor, num_tokens: int, token: str, *,  # noqa: PLR0913
                  first_block: int = 0, last: bool = True, first_token_id: int = 0) -> KVHeader:
    """The header of a frame of KV blocks laid out as `LLMEngine.export_kv` gives them."""
    return KVHeader(request_id=request_id, num_tokens=num_tokens, num_blocks=data.shape[0], block_size=data.shape[3],
                    num_layers=data.shape[1], num_kv_heads=data.shape[4], head_dim=data.shape[5],
                    dtype=str(data.dtype).removeprefix("torch."), first_token_id=first_token_id,
                    nbytes=data.numel() * data.element_size(), first_block=first_block, last=last, token=token)


def _transport_of(connector: KVSender) -> str:
    """The connector's kind as traces name it: "ucx", "loopback"."""
    return type(connector).__module__.rsplit(".", 1)[-1]


def _raise_into(stream: OutputStream, task: asyncio.Task[Any]) -> None:
    """Hand a failed task's error to the stream its consumer reads (it raises there)."""
    if not task.cancelled() and task.exception() is not None:
        stream.put(task.exception())  # type: ignore[arg-type]


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _cancel_each(receiver: KVReceiver, request_ids: list[str]) -> None:
    for request_id in request_ids:
        receiver.cancel(request_id)  # nothing for a transfer that ended


def _put_each(ready: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, output in ready:
        stream.put(output)
