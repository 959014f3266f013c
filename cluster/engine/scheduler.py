"""Iteration-level scheduling under a token budget.

Each step, running requests go first (decodes, and prefills still in progress), each taking the
tokens it still needs to compute; then waiting requests are admitted in order (priority, then
arrival) and their prompts fill whatever budget is left, in chunks if need be. When the KV pool runs
dry, the last-admitted running request is preempted: its blocks are freed and it waits again, either
to be recomputed from its tokens or to have its KV swapped back in from host memory.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import time

from cluster.common.errors import QueueFullError
from cluster.engine.block_pool import Block
from cluster.engine.config import SchedulerConfig
from cluster.engine.kv_cache_manager import CachedPrefix, KVCacheManager, cdiv
from cluster.engine.request import Request, RequestStatus
from cluster.engine.request_stats import RequestStats
from cluster.engine.scheduler_output import ScheduledRequest, SchedulerOutput, SwapOrder
from cluster.engine.spec_decode import SpecDecodeStats

# A decode worker's request whose KV will not come waits this long, without blocks, for its router to
# say which first token the client has (a prefill may have streamed one); longer, its router is gone.
PARKED_S = 30.0


class Scheduler:
    """Decides, each step, which requests run and how many tokens each computes.

    Owns the waiting queue (a heap by priority, then arrival), the running list, the decode side's
    reservations for KV arriving from a prefill worker, and the swap space's accounting; the blocks
    themselves belong to the `KVCacheManager` it is given. Called by `LLMEngine` only (`schedule`,
    then `update_from_output` with the sampled tokens; `add_request`, `abort`, the `*_remote` calls
    between steps), on the engine's one thread: it is not thread-safe and does no I/O.
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 num_swap_blocks: int = 0) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.num_swap_blocks = num_swap_blocks
        self.num_swapped_blocks = 0
        self.swapped: dict[str, int] = {}  # request id -> blocks held in host memory
        self.waiting: list[tuple[int, int, Request]] = []  # heap of (priority, arrival order, request)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.order: dict[str, int] = {}
        self.counter = itertools.count()
        self.num_preemptions = 0
        self.num_recomputes = 0  # reservations whose KV never came: their prompts computed here
        # Seconds a request runs here, from its first step to its end (recent ones, averaged): how fast
        # running requests make room for waiting ones, which the routers' admission estimates waits by.
        self.seconds_per_request = 0.0
        self.request_stats = RequestStats(max_model_len)  # vLLM's per-request histograms, counted at the end
        self.spec_stats = SpecDecodeStats()  # drafts verified and accepted (speculative decoding)
        # Disaggregation. Decode side: requests whose KV is in flight, with their lease deadlines,
        # then those whose KV has landed, admitted ahead of the waiting queue (they hold blocks).
        self.reserved: dict[str, tuple[Request, float]] = {}
        # Reserved requests whose router said which first token the client has (None: none yet), so
        # that a lost KV is recomputed after it at once; and requests whose KV was lost before their
        # router said it, parked without blocks until it does (`settle`) or `PARKED_S` passes.
        self.settled: dict[str, int | None] = {}
        self.parked: dict[str, tuple[Request, float]] = {}
        self.remote_ready: collections.deque[Request] = collections.deque()
        # Prefill side: requests that ended holding their blocks until the KV is exported.
        self.held: dict[str, Request] = {}

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if self.num_queued >= self.config.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting_requests} requests)")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.order[request.request_id] = next(self.counter)
        self._push_waiting(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        elif request_id in self.held:
            request = self.release_held(request_id)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a request: it leaves every queue and its blocks go back at once (or, for a
        prefill whose KV is still to be sent, when `release_held` is called)."""
        self._leave_queues(request)
        if request.running_since is not None and status in (RequestStatus.FINISHED_STOPPED,
                                                            RequestStatus.FINISHED_LENGTH):
            took = time.monotonic() - request.running_since
            self.seconds_per_request = took if not self.seconds_per_request else \
                0.8 * self.seconds_per_request + 0.2 * took
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.request_stats.finished(request)
        request.status = status
        if request.hold_kv and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.held[request.request_id] = request
        else:
            self.kv_cache.free(request)
        self.num_swapped_blocks -= self.swapped.pop(request.request_id, 0)
        self.requests.pop(request.request_id, None)
        self.order.pop(request.request_id, None)

    def _leave_queues(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.settled.pop(request.request_id, None)
            if self.reserved.pop(request.request_id, None) is None and \
                    self.parked.pop(request.request_id, None) is None:
                self.remote_ready.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting = [entry for entry in self.waiting if entry[2] is not request]
            heapq.heapify(self.waiting)

    @property
    def num_queued(self) -> int:
        """Requests waiting for their first turn: the queue `max_waiting_requests` bounds. Preempted
        requests wait too, but they were admitted already and must not make new ones look refused."""
        return sum(1 for _, _, request in self.waiting if request.status == RequestStatus.WAITING)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- disaggregation ------------------------------------------------------------------------

    def release_held(self, request_id: str) -> Request | None:
        """Prefill side: the KV was exported (or will never be); free the blocks."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv_cache.free(request)
        return request

    def reserve_remote(self, request: Request, lease_s: float, cached: list[Block] | None = None) -> list[int] | None:
        """Decode side: blocks for the whole prompt, to receive its KV; None when they don't fit.
        `cached`: the prompt's leading blocks found in this engine's prefix cache, taken as they are
        (the request owns them too); only the KV of the blocks after them is to arrive.

        If the KV has not arrived `lease_s` seconds from now, `expire_reservations` falls back to
        computing the prompt here.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        cached = cached or []
        num_new = request.num_prompt_tokens - len(cached) * self.kv_cache.block_size
        # Not entered in the prefix cache yet: the new blocks hold nothing until the KV arrives.
        if not self.kv_cache.allocate_slots(request, num_new, CachedPrefix(blocks=cached), cache_full=False):
            return None
        request.num_reused_blocks = len(cached)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.order[request.request_id] = next(self.counter)
        self.reserved[request.request_id] = (request, time.monotonic() + lease_s)
        return self.kv_cache.block_ids(request.request_id)

    def admit_remote(self, request_id: str, first_token_id: int) -> Request:
        """The prompt's KV is in the reserved blocks and the prefill sampled `first_token_id`, which
        may end the request already (EOS, a stop token, max_tokens 1): then it finishes here."""
        request, _ = self.reserved[request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = request.num_reused_blocks * self.kv_cache.block_size
        request.remote_kv_time = time.monotonic()
        self.kv_cache.cache_blocks(request, request.num_prompt_tokens)
        request.append_output_token(first_token_id)
        status = request.check_stop(self.max_model_len)
        if status is not None:
            self.finish(request, status)  # leaves `reserved` there
        else:
            del self.reserved[request_id]
            self.remote_ready.append(request)
        self.settled.pop(request_id, None)
        return request

    def fail_remote(self, request_id: str, first_token_id: int | None = None) -> Request | None:
        """The KV will not come: give back the blocks and compute the prompt here instead. With
        `first_token_id` (the prefill's, which the client already has) the request goes on after it:
        the prompt and that token are computed, and the next token sampled is the second, not a first
        token of this worker's own spliced after the prefill's. That token may end the request."""
        entry = self.reserved.pop(request_id, None) or self.parked.pop(request_id, None)
        if entry is None:
            return None
        self.settled.pop(request_id, None)
        self.num_recomputes += 1
        request = entry[0]
        self.kv_cache.free(request)
        request.status = RequestStatus.WAITING
        self._push_waiting(request)
        if first_token_id is not None:
            request.append_output_token(first_token_id)
            status = request.check_stop(self.max_model_len)
            if status is not None:
                self.finish(request, status)
        return request

    def settle(self, request_id: str, first_token_id: int | None) -> Request | None:
        """The router says which first token the client has (None: none). A parked request is
        recomputed after it now (returned); a reserved one keeps it, in case its KV does not come."""
        if request_id in self.parked:
            return self.fail_remote(request_id, first_token_id)
        if request_id in self.reserved:
            self.settled[request_id] = first_token_id
        return None

    def kv_lost(self, request_id: str, now: float | None = None) -> Request | None:
        """The KV will not come (its lease ended, or it arrived broken). The decode worker cannot
        tell whether a prefill already streamed a first token to the client, so it never samples one
        of its own here (with unseeded sampling that would splice two answers): if the router said
        the token (`settle`), the prompt is recomputed after it at once (returned); else the blocks go
        back and the request is parked until the router says it (`settle`, `fail_remote`)."""
        entry = self.reserved.get(request_id)
        if entry is None:
            return None
        if request_id in self.settled:
            return self.fail_remote(request_id, self.settled[request_id])
        del self.reserved[request_id]
        self.kv_cache.free(entry[0])
        self.parked[request_id] = (entry[0], (time.monotonic() if now is None else now) + PARKED_S)
        return None

    def expire_reservations(self, now: float | None = None) -> list[Request]:
        """Leases that ended (`kv_lost`) and parked requests nobody claimed (aborted: their router is
        gone). Returns the requests that have news for their streams: recomputed after a streamed
        first token, or aborted."""
        now = time.monotonic() if now is None else now
        news = []
        for request_id in [request_id for request_id, (_, deadline) in self.reserved.items() if deadline <= now]:
            request = self.kv_lost(request_id, now)
            if request is not None and request.output_token_ids:
                news.append(request)
        for request_id in [request_id for request_id, (_, deadline) in self.parked.items() if deadline <= now]:
            request = self.parked[request_id][0]
            self.finish(request, RequestStatus.FINISHED_ABORTED)
            news.append(request)
        return news

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self._schedule_running(output, self.config.max_num_batched_tokens)
        if not output.preempted:
            budget = self._schedule_waiting(output, budget)
        output.num_batched_tokens = self.config.max_num_batched_tokens - budget
        output.host_copies = self.kv_cache.take_host_copies()
        return output

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance every scheduled request past the tokens it just ran: the accepted drafts and the
        model's token after them (`sampled`, in order; a stop condition met inside them drops the
        rest). Returns the requests that finished."""
        finished = []
        for scheduled in output.scheduled:
            request = scheduled.request
            token_ids = sampled[request.request_id] if scheduled.samples else ()
            num_rejected = self._verified(scheduled, len(token_ids) - 1) if scheduled.draft_token_ids else 0
            request.num_computed_tokens += scheduled.num_new_tokens - num_rejected
            if not scheduled.samples or request.status >= RequestStatus.FINISHED_STOPPED:  # a chunk, or aborted
                continue
            for token_id in token_ids:
                request.append_output_token(token_id)
                status = request.check_stop(self.max_model_len)
                if status is not None:
                    self.finish(request, status)
                    finished.append(request)
                    break
        return finished

    def _verified(self, scheduled: ScheduledRequest, num_accepted: int) -> int:
        """Count a verified row's drafts; how many were rejected (their KV slots are computed no more:
        the request's next tokens overwrite them)."""
        num_drafts = len(scheduled.draft_token_ids)
        self.spec_stats.observe(num_drafts, num_accepted)
        return num_drafts - num_accepted

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        # The hot loop of every step (one pass per running request): locals over attribute lookups.
        allocate, running, scheduled = self.kv_cache.allocate_slots, self.running, output.scheduled
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = min(len(request.all_token_ids) - request.num_computed_tokens, budget)
            if num_new <= 0:  # admitted in static mode, no budget for it yet
                index += 1
                continue
            drafts = request.draft_token_ids
            if drafts and request.num_computed_tokens + 1 == len(request.all_token_ids):  # they follow its last token
                drafts = self._fit_drafts(request, budget)
                num_new += len(drafts)
            if not allocate(request, num_new) and not self._preempt_until_fits(request, num_new, index, output):
                break  # the request preempted itself: nothing behind it can run either
            scheduled.append(self._scheduled(request, num_new, drafts))
            budget -= num_new
            index += 1
        return budget

    def _fit_drafts(self, request: Request, budget: int) -> list[int]:
        """The request's drafts that the budget and the free blocks allow: drafts are the first thing
        given up, before any request is preempted for room."""
        drafts = request.draft_token_ids[:budget - 1]
        if drafts and not self.kv_cache.can_allocate(request, 1 + len(drafts)):
            drafts = []
        return drafts

    def _preempt_until_fits(self, request: Request, num_new: int, index: int, output: SchedulerOutput) -> bool:
        while True:
            victim = self._pick_victim(index)
            self._preempt(victim, output)
            if victim is request:
                return False
            if self.kv_cache.allocate_slots(request, num_new):
                return True

    def _pick_victim(self, first_unscheduled: int) -> Request:
        """The last-admitted request not yet scheduled this step (worst priority first)."""
        candidates = self.running[first_unscheduled:]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, self.order[r.request_id]))
        return candidates[-1]

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        block_ids = self.kv_cache.free(request)
        num_blocks = len(block_ids)
        if self._can_swap(num_blocks):
            output.swap_out.append(SwapOrder(request.request_id, block_ids))
            self.swapped[request.request_id] = num_blocks
            self.num_swapped_blocks += num_blocks
        else:
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.draft_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        output.preempted.append(request)
        self._push_waiting(request)

    def _can_swap(self, num_blocks: int) -> bool:
        return (self.config.preemption_mode == "swap"
                and self.num_swapped_blocks + num_blocks <= self.num_swap_blocks)

    def _schedule_waiting(self, output: SchedulerOutput, budget: int) -> int:
        static = self.config.batching == "static"
        if static and self.running:
            return budget
        budget = self._schedule_remote_ready(output, budget)
        while self.waiting and len(self.running) < self.config.max_num_seqs and (budget > 0 or static):
            request = self.waiting[0][2]
            num_new = self._admit(request, budget, output)
            if num_new is None:
                break
            heapq.heappop(self.waiting)
            request.status = RequestStatus.RUNNING
            request.running_since = request.running_since or time.monotonic()
            self.running.append(request)
            if num_new > 0:
                output.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
        return budget

    def _schedule_remote_ready(self, output: SchedulerOutput, budget: int) -> int:
        """Requests whose KV arrived go first: they already hold their blocks."""
        while self.remote_ready and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.remote_ready[0]
            if not self.kv_cache.allocate_slots(request, 1):
                break
            self.remote_ready.popleft()
            request.status = RequestStatus.RUNNING
            request.running_since = request.running_since or time.monotonic()
            self.running.append(request)
            output.scheduled.append(self._scheduled(request, 1))
            budget -= 1
        return budget

    def _admit(self, request: Request, budget: int, output: SchedulerOutput) -> int | None:
        """Reserve blocks for a waiting request; the tokens it runs this step, or None if it can't."""
        swapped_blocks = self.swapped.get(request.request_id)
        # A request still owed prompt logprobs needs the logits of every prompt position: no cache hit (as vLLM).
        skip_cache = swapped_blocks or request.num_prompt_logprobs_due > 0
        cached, num_cached = (None, 0) if skip_cache else self.kv_cache.find_cached_prefix(request)
        remaining = request.num_tokens - request.num_computed_tokens - num_cached
        if self.config.batching == "static":
            num_new, num_reserved = min(remaining, budget), remaining
        elif self.config.enable_chunked_prefill:
            num_new = num_reserved = min(remaining, budget)
        else:
            num_new = num_reserved = remaining
            if remaining > budget:
                return None
        if not self.kv_cache.allocate_slots(request, num_reserved, cached):
            return None
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        request.num_computed_tokens += num_cached
        if swapped_blocks:
            block_ids = self.kv_cache.block_ids(request.request_id)[:swapped_blocks]
            output.swap_in.append(SwapOrder(request.request_id, block_ids))
            self.num_swapped_blocks -= self.swapped.pop(request.request_id)
        return num_new

    def _scheduled(self, request: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledRequest:
        samples = request.num_computed_tokens + num_new - len(drafts or ()) >= len(request.all_token_ids)
        return ScheduledRequest(request, num_new, self.kv_cache.block_ids_of[request.request_id], samples,
                                drafts or [])

    def _push_waiting(self, request: Request) -> None:
        if request.status != RequestStatus.PREEMPTED:
            request.status = RequestStatus.WAITING
        priority = request.priority if self.config.policy == "priority" else 0
        heapq.heappush(self.waiting, (priority, self.order[request.request_id], request))

    def check_request_fits(self, request: Request) -> None:
        """Refuse, up front, a request that could never run: it would wait forever."""
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"the prompt has {request.num_prompt_tokens} tokens; this model's context is "
                             f"{self.max_model_len} tokens, including at least one generated token")
        needed = cdiv(request.num_prompt_tokens + 1, self.kv_cache.block_size)
        if needed > self.kv_cache.pool.num_blocks:
            raise ValueError(f"the prompt needs {needed} KV blocks but the pool has only "
                             f"{self.kv_cache.pool.num_blocks}; raise num_blocks or kv_cache_memory_gb")
