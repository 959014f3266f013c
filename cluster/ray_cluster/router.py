"""The router: a Ray actor that picks workers for each request and moves it through them.

One request's path in disaggregated mode (see docs/ray_cluster.md):
1. the router orders decode workers by the prefix of the prompt they hold cached, then by load, and
   asks each in turn to reserve the prompt's blocks (keeping those it holds: only the rest is sent,
   or, when that rest is short, it computes the prompt itself and no prefill worker is asked);
2. it picks the prefill worker with the least prompt work ahead (its queue, less the prefix it
   likely caches: `cluster.ray_cluster.routing_policy`), which computes the prompt, sends its KV over UCX to the
   decode worker's receiver chunk by chunk as it computes, and streams back the first token; with
   `prefix_fetch`, a prefix that another worker caches and it does not is first sent to it by that
   worker (`_fetch_prefix`) instead of computed;
3. the decode worker lands the KV in the reserved blocks and admits the request; the router relays
   its tokens. A failed send or a lost prefill worker makes the decode worker recompute the prompt;
   a refusal or a decode worker lost before its first token sends the request to the next one.

Across the process boundary a request's tokens travel as small `TokenEvent`s (diffs), never the
whole output again, and all requests' events of a step in one message per hop (`channels`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ray.exceptions import RayActorError

from cluster.common.block_hashes import prefix_hashes
from cluster.common.errors import NoCapacityError, QueueFullError, ServiceUnavailable
from cluster.common.events import TokenEvent
from cluster.common.loads import KVTicket, PrefixReuse, WorkerLoad
from cluster.common.roles import Mode, Role, RoutingPolicy
from cluster.common.sampling_params import SamplingParams
from cluster.observability import tracing
from cluster.ray_cluster.channels import ChannelHost, Inboxes
from cluster.ray_cluster.routing_policy import LOAD_POLL_S, POLL_TIMEOUT_S, decode_rank, prefill_cost
from cluster.ray_cluster.worker_actor import RAY_NAMESPACE, control
from cluster.state.connect import connect_state

log = logging.getLogger(__name__)


WAIT_POLL_S = 0.1  # how often a request waiting for a restarted worker looks
MIN_FETCH_BLOCKS = 2  # fewer blocks than this are computed rather than fetched from a peer (three round trips)
RECOVERY_PHASES = ("total", "restart", "model_load", "init_rest", "warm_up", "rejoin")
MAX_RESUMES = 3  # a request whose worker dies is run again elsewhere, at most this many times


def actor_id_of(handle: Any) -> str:
    """A Ray actor handle's actor id (hex); empty for what is not one."""
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else ""


@dataclass(frozen=True, slots=True)
class PrefillPick:
    """The prefill worker for a prompt (None: none alive), the worker to fetch a prefix from (None: no
    fetch), and the prompt tokens it will compute: its queue grows by those, not by the cached ones."""

    worker: Any
    source: PrefixSource | None = None
    work: int = 0


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """A worker caching a prompt's blocks [first_block, stop_block) that the prefill worker picked lacks."""

    worker: Any
    first_block: int
    stop_block: int


class _NoRoom(RuntimeError):
    """No worker took the request (none alive, or none with room), before any of its events."""


class _WorkerLost(RuntimeError):
    """The worker running a request died after it had streamed tokens of its own."""


class SpliceError(RuntimeError):
    """A decode worker went on after a first token other than the one the client has."""


class RepeatFilter:
    """The decode worker restates the first token the prefill worker already streamed: drop the
    repeat, keeping any text it adds (the prefill holds back a partial UTF-8 character) and the
    tokens after it (a decode stream held back by backpressure merges its first outputs into one).
    A restated first token that differs would splice two answers: refused (`SpliceError`)."""

    def __init__(self) -> None:
        self.sent = 0  # tokens relayed so far
        self.first_text = ""
        self.first_token_id: int | None = None

    def news(self, event: TokenEvent) -> TokenEvent | None:
        if event.index == 0 and self.sent == 0:
            self.first_text = event.text
            self.first_token_id = event.token_ids[0] if event.token_ids else None
        elif event.index == 0 and event.token_ids and event.token_ids[0] != self.first_token_id:
            raise SpliceError(f"{event.request_id}: the decode worker went on after token {event.token_ids[0]}, "
                              f"the client has {self.first_token_id}: refusing to splice two answers")
        if event.index >= self.sent:
            self.sent = event.index + len(event.token_ids)
            return event
        repeated = self.sent - event.index
        tokens = event.token_ids[repeated:]
        # The restated first token comes without logprobs (the prefill worker sent them): the event's
        # logprobs, when asked for, are those of its last tokens.
        logprobs = event.logprobs[max(0, len(event.logprobs) - len(tokens)):] if tokens else []
        extra = event.text.removeprefix(self.first_text) if event.text.startswith(self.first_text) else ""
        if not (tokens or extra or event.finished):
            return None
        news = replace(event, index=self.sent, token_ids=tokens, text=extra, logprobs=logprobs, prompt_logprobs=None)
        self.sent += len(tokens)
        return news


@dataclass(frozen=True, slots=True)
class RouterConfig:
    mode: str = Mode.DISAGGREGATED
    lease_s: float = 30.0
    block_size: int = 16
    model_name: str = ""  # the prefix hashes chain from it, as the workers' caches do
    redis_url: str = ""  # shared with other router replicas and fed by the workers; else this router's own
    policy: str = RoutingPolicy.KV_AWARE  # how prefill workers are picked (`RoutingPolicy`)
    worker_wait_s: float = 60.0  # with no live decode (or colocated) worker, wait this long for one
    # A new prompt is refused (429) when every prefill worker has more than this many seconds of
    # prompts ahead of it (queued prompt tokens over its measured throughput); 0: no limit.
    max_prefill_wait_s: float = 10.0
    # A new request goes to no decode worker whose requests queued for a running slot would keep it
    # waiting longer than this (queued over slots, times a request's measured running time); when
    # every one would, it is refused (429). 0: no limit.
    max_decode_wait_s: float = 10.0
    traces: tracing.TracingConfig = field(default_factory=tracing.TracingConfig)  # where this router's spans go
    # Decode-side prefix reuse: a request goes to the decode worker holding the longest beginning of
    # its prompt, which keeps those blocks; only the rest is prefilled and sent, or computed there
    # when shorter than `local_prefill_threshold` tokens (`PrefixReuse`).
    decode_prefix_reuse: bool = True
    local_prefill_threshold: int = 0
    # A prefill worker takes the prompt's blocks another worker caches (and it does not) from that worker
    # over the KV transfer, instead of computing them (`_fetch_prefix`).
    prefix_fetch: bool = False

    @property
    def reuse(self) -> PrefixReuse:
        return PrefixReuse(self.decode_prefix_reuse, self.local_prefill_threshold)




class Router(ChannelHost):
    """Picks workers for each request and relays its tokens; holds no engine of its own.

    A Ray actor (async: every method runs on the actor's one event loop). Owns the worker handles it
    routes to (`prefill` and `decode` are (worker id, Ray actor name, handle) triples, more found
    later in the registry), the in-flight counts and last polled loads it ranks them by, the dead
    set, and its decision counters. Called by `Cluster` (`generate`, `abort`, `stats`), one of
    several replicas; a background task polls the workers' loads and the registry every
    `LOAD_POLL_S`.
    """

    streams = frozenset({"generate"})  # what a gateway opens on its channel to this router (`channels`)

    def __init__(self, prefill: list[tuple[str, str, Any]], decode: list[tuple[str, str, Any]],
                 config: RouterConfig) -> None:
        self.config = config
        if config.traces.enabled:  # a Ray actor: its process's own tracer provider
            tracing.configure(config.traces, "pdserve-router")
        self.routes: dict[str, tracing.Route] = {}  # each traced run's span, by its (attempt's) request id
        self.ids = {id(handle): worker_id for worker_id, _, handle in prefill + decode}
        # Ray actor names by worker id: a listing under a known id with another name is a new actor.
        # (Ray actor name, actor id) by worker id: a listing under a known id with another name or
        # actor id is a new actor (its gateway made its workers again). Ray's handles carry the id.
        self.addresses = {worker_id: (address, actor_id_of(handle)) for worker_id, address, handle in prefill + decode}
        self.prefill = [handle for _, _, handle in prefill]
        self.decode = [handle for _, _, handle in decode]
        # Kept here so routing costs no round trip: requests in flight per decode (or colocated)
        # worker, prompt tokens in flight per prefill worker, and the loads last polled.
        self.in_flight: dict[int, int] = {}
        self.queued_tokens: dict[int, int] = {}
        self.loads: dict[int, WorkerLoad] = {}
        self.poller: asyncio.Task[None] | None = None
        self.polled = asyncio.Event()  # set once every worker's load was asked: admission needs their rates
        # Which prefixes each worker holds: published by the workers into Redis, or (no Redis) this
        # router's own record of where it sent which prompts.
        self.state = connect_state(config.redis_url)
        self.decisions = {"reserve_refused": 0, "transfer_failed": 0, "rerouted": 0, "prefix_hits": 0, "resumed": 0,
                          "rejoined": 0, "refused_overloaded": 0, "splice_refused": 0,
                          "decode_prefix_hits": 0, "local_prefills": 0, "prefix_fetches": 0,
                          "prefix_fetch_failed": 0}
        self.attempts: dict[str, str] = {}  # request id -> the id its current run has (resumed runs differ)
        # Admitted requests whose prefill has not ended -> prompt tokens to compute (all of them until a
        # prefill worker is picked, then those it does not hold cached or fetch).
        self.ahead: dict[str, int] = {}
        # Requests aborted while in flight: a run between two attempts (resuming) must not start again.
        self.aborted: set[str] = set()
        self.dead: set[int] = set()  # workers found dead: skipped until a load poll answers (restarted)
        self.down_since: dict[int, tuple[float, float]] = {}  # dead workers: (monotonic, wall clock) found dead
        # Recoveries of dead workers, rejoined: how many, and the seconds of each phase summed (`RECOVERY_PHASES`).
        self.recoveries: dict[str, float] = dict.fromkeys(("count", *RECOVERY_PHASES), 0.0)
        self.retired: list[Any] = []  # handles replaced by new actors under the same worker id
        self.turn = 0
        self.channels = Inboxes()  # one channel to each worker, all requests' tokens on it
        # Workers being removed (the scaler drains them, or their load says so): no new requests go
        # there; those they hold go on. Worker ids.
        self.draining: set[str] = set()

    def _live(self, handles: list[Any]) -> list[Any]:
        return [handle for handle in handles if id(handle) not in self.dead]

    def _open(self, handles: list[Any]) -> list[Any]:
        """The live workers that take new requests (not draining)."""
        return [handle for handle in self._live(handles) if self.ids[id(handle)] not in self.draining]

    def _decode_order(self) -> list[Any]:
        return sorted(self._open(self.decode),
                      key=lambda h: decode_rank(self.in_flight.get(id(h), 0), self.loads.get(id(h))))

    def _decode_wait_s(self, handle: Any) -> float:
        """How long a new request would wait on this decode worker for a running slot: the requests
        here beyond its slots, drained `max_num_seqs` at a time, each batch in a request's measured
        running time. 0 while that time is unknown."""
        load = self.loads.get(id(handle))
        if load is None or not load.max_num_seqs or not load.seconds_per_request:
            return 0.0
        ahead = self.in_flight.get(id(handle), 0) + 1 - load.max_num_seqs
        return max(ahead, 0) / load.max_num_seqs * load.seconds_per_request

    def _decode_admitting(self) -> list[Any]:
        """The decode workers, best first, that a new request would not wait on past
        `max_decode_wait_s`; QueueFullError (429) when every live one would keep it waiting longer."""
        order = self._decode_order()
        if not self.config.max_decode_wait_s or not order:
            return order
        admitting = [handle for handle in order if self._decode_wait_s(handle) <= self.config.max_decode_wait_s]
        if not admitting:
            self.decisions["refused_overloaded"] += 1
            wait_s = min(self._decode_wait_s(handle) for handle in order)
            raise QueueFullError(f"the decode workers have {wait_s:.1f} s of requests queued (more than "
                                 f"{self.config.max_decode_wait_s:g} s): the cluster is overloaded; retry later")
        return admitting

    async def _pick_prefill(self, prompt: list[int], route: tracing.Route = tracing.UNTRACED,
                            cache_domain: str = "") -> PrefillPick:
        """The live prefill worker with the least prompt work before this one (its queue plus the
        part of this prompt it does not hold cached in the request's cache domain); with
        `prefix_fetch`, a prefix another worker holds counts as held by each (it can be fetched), and
        that worker is returned too where the one picked lacks at least `MIN_FETCH_BLOCKS` of it."""
        live = self._open(self.prefill)
        if not live:
            return PrefillPick(None)
        if self.config.policy == RoutingPolicy.ROUND_ROBIN:  # the baselines the benchmark compares against
            self.turn += 1
            return PrefillPick(live[self.turn % len(live)], work=len(prompt))
        # Hashed in the request's domain, as the worker will: blocks of another domain are no hit there.
        hashes = prefix_hashes(prompt, self.config.block_size, self.config.model_name, cache_domain)
        kv_aware = self.config.policy == RoutingPolicy.KV_AWARE and hashes
        fetching = self.config.prefix_fetch and kv_aware
        # Any live worker can send what it caches: a decode worker, a draining one (it takes no new prompts).
        open_ids = {id(handle) for handle in live}
        donors = [h for h in self._live(self.prefill + self.decode) if id(h) not in open_ids] if fetching else []
        cached = await self.state.match(hashes, [self.ids[id(h)] for h in live + donors]) if kv_aware else {}
        source = max(live + donors, key=lambda h: cached.get(self.ids[id(h)], 0)) if fetching else None
        fetchable = cached.get(self.ids[id(source)], 0) if source is not None else 0

        def cost(handle: Any) -> tuple[int, int]:
            held = cached.get(self.ids[id(handle)], 0)
            # Ties go to the worker holding more itself: a fetch costs a transfer.
            return prefill_cost(self.queued_tokens.get(id(handle), 0), len(prompt), max(held, fetchable),
                                self.config.block_size), -held

        best = min(live, key=cost)
        held = cached.get(self.ids[id(best)], 0)
        if held:
            self.decisions["prefix_hits"] += 1
        route.chose(cached_blocks=held, cache_hit=bool(held))
        if not self.config.redis_url and kv_aware:  # no worker publishes here: keep our own record
            await self.state.publish_blocks(self.ids[id(best)], hashes, [])
        if source is None or source is best or fetchable - held < MIN_FETCH_BLOCKS:
            return PrefillPick(best, None, prefill_cost(0, len(prompt), held, self.config.block_size))
        return PrefillPick(best, PrefixSource(source, held, fetchable),
                           prefill_cost(0, len(prompt), fetchable, self.config.block_size))

    async def _fetch_prefix(self, prefill: Any, source: PrefixSource, request_id: str, prompt: list[int],
                            params: SamplingParams) -> str:
        """Have `source.worker` send the prompt's blocks [first_block, stop_block) it caches to the
        prefill worker, which caches them: its prefill then starts after them. The fetch id to pass to
        the prefill, or "" where nothing was fetched (the donor holds less than its index said, the
        prefill worker has no room, the send failed): the prefill computes those blocks, nothing else
        is lost. Either way no block stays pinned on either worker."""
        fetch_id, donor, domain = f"{request_id}:prefix", source.worker, params.cache_domain
        route = self._route(request_id)
        fetched, calling = False, donor
        try:
            offered = await donor.offer_prefix.remote(fetch_id, prompt, domain, source.first_block, source.stop_block)
            calling = prefill
            ticket = await prefill.expect_prefix.remote(fetch_id, prompt, domain, source.first_block, offered) \
                if offered >= MIN_FETCH_BLOCKS else None
            calling = donor
            if ticket is not None:
                await donor.send_prefix.remote(fetch_id, ticket)
                fetched = True
                self.decisions["prefix_fetches"] += 1
                route.chose(prefix_donor=self.ids.get(id(donor)), prefix_fetched_blocks=offered)
        except Exception as error:  # a donor lost or a send failed: the prefill computes the prefix
            if isinstance(error, RayActorError):
                self._mark_dead(calling)
            self.decisions["prefix_fetch_failed"] += 1
            log.warning("%s: fetching its prefix from %s failed (%r): the prefill computes it", request_id,
                        self.ids.get(id(donor)), error)
        finally:
            if not fetched:  # release what either side pinned (the prefill releases its side once done)
                for handle in (donor, prefill):
                    control(handle.release_prefix).remote(fetch_id)
        return fetch_id if fetched else ""

    async def _poll_loads(self) -> None:
        """In the background: add the workers the shared registry lists, and refresh every worker's
        load (waiting queue, free blocks). A dead worker that answers again (Ray restarted it) rejoins."""
        while True:
            try:
                if self.config.redis_url:
                    await self._discover()
            except Exception as error:  # the registry unreadable this time: the loads go on all the same
                log.warning("reading the worker registry failed: %r", error)
            polls = await asyncio.gather(*(self._poll(handle) for handle in self.prefill + self.decode),
                                         return_exceptions=True)
            for outcome in polls:
                if outcome is not None:  # one worker's poll went wrong: the others' and the next round go on
                    log.warning("load poll failed: %r", outcome)
            self.polled.set()
            await asyncio.sleep(LOAD_POLL_S)

    async def _poll(self, handle: Any) -> None:
        try:
            if id(handle) in self.dead:  # restarted, it starts on its first call of the default group
                await asyncio.wait_for(handle.start.remote(), POLL_TIMEOUT_S)
            self.loads[id(handle)] = await asyncio.wait_for(control(handle.load).remote(), POLL_TIMEOUT_S)
        except RayActorError:
            self._mark_dead(handle)
            if self.ids[id(handle)] in self.draining:  # drained and gone: not to be restarted
                self._forget(self.ids[id(handle)])
            return
        except Exception as error:  # a busy or restarting worker: keep its last load
            log.debug("load poll failed: %r", error)
            return
        if self.loads[id(handle)].draining:  # told by its load: the scaler of another gateway drains it
            self.draining.add(self.ids[id(handle)])
        if id(handle) in self.dead:
            self.dead.discard(id(handle))
            log.warning("worker %s answers again: routing to it", self.ids[id(handle)])
            self.decisions["rejoined"] += 1
            await self._log_recovery(handle)
            if not self.config.redis_url:  # it restarted with an empty cache
                await self.state.forget_worker(self.ids[id(handle)])

    async def _discover(self) -> None:
        """Add the workers listed in the shared registry that this router does not know yet: those
        another gateway started, or added since (router replicas share the pools this way). A known
        id listed under a new actor name (its gateway restarted and made new workers) replaces the
        old actor."""
        import ray

        roles = (Role.COLOCATED,) if self.config.mode == Mode.COLOCATED else (Role.PREFILL, Role.DECODE)
        for info in await self.state.workers():
            if info.role not in roles or info.meta.get("model") != self.config.model_name \
                    or self.addresses.get(info.worker_id) == (info.address, info.meta.get("actor_id")):
                continue
            try:
                handle = ray.get_actor(info.address, namespace=info.meta.get("namespace", RAY_NAMESPACE))
            except ValueError:  # listed, but the actor is gone (its registration has not expired yet)
                continue
            except Exception as error:  # a record naming no actor Ray can look up: the others still count
                log.warning("worker %s's record names no reachable actor (%s): %r", info.worker_id, info.address,
                            error)
                continue
            pool = self.prefill if info.role == Role.PREFILL else self.decode
            old = next((h for h in pool if self.ids[id(h)] == info.worker_id), None)
            if old is not None:
                pool.remove(old)
                self._mark_dead(old)
                self.retired.append(old)  # kept, so that no new handle gets its id() (our dicts' key)
            self.ids[id(handle)] = info.worker_id
            self.addresses[info.worker_id] = (info.address, actor_id_of(handle))
            pool.append(handle)
            log.info("found %s worker %s in the registry (%s)", info.role, info.worker_id, info.address)

    async def add_worker(self, role: str, worker_id: str, address: str) -> None:
        """Route to a worker the scaler added (the Ray actor named `address`); with Redis the registry
        lists it too, and whichever comes first adds it."""
        import ray

        if worker_id in self.addresses and worker_id not in self.draining:  # known already
            return
        self._forget(worker_id)  # a drained worker's id used again: the new actor replaces it
        handle = ray.get_actor(address, namespace=RAY_NAMESPACE)
        self.ids[id(handle)] = worker_id
        self.addresses[worker_id] = (address, actor_id_of(handle))
        (self.prefill if role == Role.PREFILL else self.decode).append(handle)
        log.info("added %s worker %s (%s)", role, worker_id, address)

    async def drain_worker(self, worker_id: str) -> None:
        """Send no new requests to the worker (the scaler removes it); those it holds go on."""
        self.draining.add(worker_id)

    async def remove_worker(self, worker_id: str) -> None:
        """Forget a drained worker (the scaler stopped it)."""
        self._forget(worker_id)
        log.info("removed worker %s", worker_id)

    def _forget(self, worker_id: str) -> None:
        for pool in (self.prefill, self.decode):
            for handle in [h for h in pool if self.ids[id(h)] == worker_id]:
                pool.remove(handle)
                self._mark_dead(handle)
                self.retired.append(handle)  # kept, so that no new handle gets its id() (our dicts' key)
        self.draining.discard(worker_id)
        self.addresses.pop(worker_id, None)

    def _route(self, request_id: str) -> tracing.Route:
        """The span of a request's run, to record decisions in and pass on (`UNTRACED` when untraced)."""
        return self.routes.get(request_id, tracing.UNTRACED) if self.routes else tracing.UNTRACED

    def _mark_dead(self, handle: Any) -> None:
        self.dead.add(id(handle))
        self.loads.pop(id(handle), None)
        self.down_since.setdefault(id(handle), (time.monotonic(), time.time()))

    async def _log_recovery(self, handle: Any) -> None:
        """A dead worker answers again: how long it was out of service, and where the time went
        (each phase's seconds summed in `recoveries`, exported as pdserve:worker_recovery_seconds)."""
        found = self.down_since.pop(id(handle), None)
        if found is None:
            return
        total = time.monotonic() - found[0]
        try:
            timings = await asyncio.wait_for(control(handle.startup).remote(), POLL_TIMEOUT_S)
        except Exception as error:  # the timeline is a report: the worker serves all the same
            log.warning("worker %s answers again after %.1f s (its start timings: %r)", self.ids[id(handle)], total,
                        error)
            return
        phases = {"total": total, "restart": max(0.0, timings["init_began"] - found[1]),
                  "model_load": timings["model_load_s"], "init_rest": timings["init_s"] - timings["model_load_s"],
                  "warm_up": timings.get("warm_up_s", 0.0),
                  "rejoin": max(0.0, time.time() - timings.get("serving_since", time.time()))}
        self.recoveries["count"] += 1
        for phase, seconds in phases.items():
            self.recoveries[phase] += seconds
        log.warning("worker %s back in service %.1f s after it was found dead: Ray restarted its process in %.1f s, "
                    "the model loaded in %.1f s (the rest of its start %.1f s), warm-up %.1f s, routed to %.1f s "
                    "after", self.ids[id(handle)], *phases.values())

    async def recovery_stats(self) -> dict[str, float]:
        """Recoveries seen by this router: "count", and each phase's seconds summed (`RECOVERY_PHASES`)."""
        return dict(self.recoveries)

    async def live_workers(self) -> list[str]:
        """The ids of the workers this router sends requests to now."""
        return sorted(self.ids[id(handle)] for handle in self._live(self.prefill + self.decode))

    async def stats(self) -> dict[str, int]:
        return dict(self.decisions)

    async def state_fallbacks(self) -> int:
        """Calls to the shared state (Redis) answered by a fallback since start: routing by load only."""
        return sum(getattr(self.state, "fallbacks", {}).values())

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       trace: str = "") -> AsyncIterator[TokenEvent]:
        """Stream the request's tokens. A worker lost after it streamed tokens of its own is replaced:
        the request runs again elsewhere from its prompt plus the tokens already sent (exact for
        greedy decoding), and the client sees one unbroken stream."""
        if self.poller is None:
            self.poller = asyncio.get_running_loop().create_task(self._poll_loads())
        await self.polled.wait()  # the first request too is admitted by the workers' rates (from warm-up)
        try:
            with tracing.route(request_id, trace, self.config.mode) as route:
                async for event in self._runs(request_id, prompt, params, route):
                    yield event
        finally:
            self.aborted.discard(request_id)

    async def _runs(self, request_id: str, prompt: list[int], params: SamplingParams,
                    route: tracing.Route = tracing.UNTRACED) -> AsyncIterator[TokenEvent]:
        """`generate`'s attempts: the first, then resumed ones after the tokens already sent."""
        sent: list[int] = []
        sent_text = ""  # what the client has of `sent`: a resumed run's text goes on after it
        for attempt in range(MAX_RESUMES + 1):
            if request_id in self.aborted:  # aborted while it was being resumed: no new run
                yield TokenEvent(request_id, len(sent), [], "", True, "abort", len(prompt), "router")
                return
            left = params.max_tokens - len(sent)
            if left <= 0:  # the lost worker had streamed every token: only the ending was missing
                yield TokenEvent(request_id, len(sent), [], "", True, "length", len(prompt), "router")
                return
            if attempt == 0:  # refused before it holds anything here
                self._admit(request_id, len(prompt))  # a resumed request is never refused: its client has tokens
            attempt_id = request_id if attempt == 0 else f"{request_id}-resume{attempt}"
            self.attempts[request_id] = attempt_id
            if route.span is not None:
                self.routes[attempt_id] = route
            # The client has the prompt's logprobs with its first token: a resumed run must not send them again.
            remaining = replace(params, max_tokens=left, min_tokens=max(0, params.min_tokens - len(sent)),
                                seed_offset=params.seed_offset + len(sent),
                                resumed_text=params.resumed_text + sent_text,
                                prompt_logprobs=params.prompt_logprobs if not sent else None)
            before = len(sent)  # the resumed run counts its tokens from 0: shift them after these
            ended = False
            try:
                async for event in self._attempt(attempt_id, prompt + sent, remaining, resumed=attempt > 0,
                                                 wanted=lambda: request_id not in self.aborted):
                    event = replace(event, request_id=request_id, index=event.index + before,
                                    num_prompt_tokens=len(prompt))
                    sent += event.token_ids
                    sent_text += event.text
                    ended = event.finished
                    yield event
                if not ended and request_id in self.aborted:  # it stopped waiting to be resumed
                    yield TokenEvent(request_id, len(sent), [], "", True, "abort", len(prompt), "router")
                return
            except _WorkerLost as lost:
                if ended:  # it died after its last event: the request is whole, nothing to resume
                    return
                log.warning("%s: %s lost after %d tokens; resuming elsewhere", request_id, lost, len(sent))
                self.decisions["resumed"] += 1
            finally:
                self.attempts.pop(request_id, None)
                self.ahead.pop(request_id, None)
                self.routes.pop(attempt_id, None)
        raise NoCapacityError(f"{request_id}: workers kept failing ({MAX_RESUMES} resumes)")

    async def _attempt(self, request_id: str, prompt: list[int], params: SamplingParams, resumed: bool = False,
                       wanted: Callable[[], bool] = lambda: True) -> AsyncIterator[TokenEvent]:
        """One run of the request; raises `_WorkerLost` if its worker dies after streaming tokens. A
        resumed run (its client has tokens) that finds no room waits for some, `worker_wait_s` at
        most, rather than fail a stream that has begun; a new one is refused at once. A run no longer
        `wanted` (aborted meanwhile) stops waiting and yields nothing."""
        await self._wait_for_a_live_worker(wanted)
        deadline = time.monotonic() + self.config.worker_wait_s
        while wanted():
            run = self._colocated(request_id, prompt, params, resumed) if self.config.mode == Mode.COLOCATED \
                else self._split(request_id, prompt, params, resumed)
            try:
                async for event in run:
                    yield event
                return
            except _NoRoom as error:
                if not resumed or time.monotonic() >= deadline:
                    raise NoCapacityError(str(error)) from None
            await asyncio.sleep(WAIT_POLL_S)

    async def _colocated(self, request_id: str, prompt: list[int], params: SamplingParams,
                         resumed: bool) -> AsyncIterator[TokenEvent]:
        for worker in self._decode_order() if resumed else self._decode_admitting():
            streamed = False
            try:
                with self._holding(worker):
                    self._route(request_id).chose(worker=self.ids.get(id(worker)))
                    async for event in self.channels.stream(worker, "generate", request_id, prompt, params,
                                                   self._route(request_id).traceparent):
                        streamed = streamed or bool(event.token_ids)
                        yield event
                return
            except RayActorError as error:
                self._mark_dead(worker)
                if streamed:
                    raise _WorkerLost(f"worker {self.ids.get(id(worker))}") from error
        raise _NoRoom("no worker is alive")

    async def _split(self, request_id: str, prompt: list[int], params: SamplingParams,
                     resumed: bool) -> AsyncIterator[TokenEvent]:
        """The disaggregated run: the first decode worker with room reserves, a prefill worker computes."""
        seen = RepeatFilter()
        order = self._decode_order() if resumed else self._decode_admitting()
        for decode in await self._by_decode_prefix(order, prompt, params.cache_domain):
            try:
                with self._holding(decode):  # counted from the reservation on, so a burst spreads out
                    ticket = await decode.reserve.remote(request_id, prompt, params, self.config.lease_s,
                                                         self._route(request_id).traceparent, self.config.reuse)
                    if ticket is None:
                        self.decisions["reserve_refused"] += 1
                        continue
                    self._route(request_id).chose(decode_worker=self.ids.get(id(decode)),
                                                  decode_reused_blocks=ticket.reused_blocks)
                    await self._note_decode_prefix(decode, ticket, prompt, params.cache_domain)
                    async for event in self._disaggregated(decode, ticket, request_id, prompt, params):
                        news = self._news(seen, event)
                        if news is not None:
                            yield news
                return
            except RayActorError as error:
                self._mark_dead(decode)
                if seen.sent:  # the client has tokens (the prefill's first one, at least): resumed after them,
                    # never prefilled again from the prompt alone (a new first token would be spliced on)
                    raise _WorkerLost(f"decode worker {self.ids.get(id(decode))}") from error
                log.warning("decode worker lost before admitting %s: sending it elsewhere", request_id)
                self.decisions["rerouted"] += 1
        raise _NoRoom(f"no decode worker has room for a {len(prompt)}-token prompt now")

    async def _by_decode_prefix(self, order: list[Any], prompt: list[int], cache_domain: str) -> list[Any]:
        """With decode-side reuse, the decode workers holding the longest beginning of the prompt first
        (those blocks need not travel again); the others, and ties, in `order`."""
        if not self.config.decode_prefix_reuse or len(order) < 2:
            return order
        hashes = prefix_hashes(prompt, self.config.block_size, self.config.model_name, cache_domain)
        held = await self.state.match(hashes, [self.ids[id(h)] for h in order]) if hashes else {}
        # Ranked by load again after the lookup: requests that arrived together were counted in flight
        # meanwhile (a Redis round trip), and would otherwise all go where the first one went.
        return sorted(order, key=lambda handle: (-held.get(self.ids[id(handle)], 0), decode_rank(
            self.in_flight.get(id(handle), 0), self.loads.get(id(handle)))))

    async def _note_decode_prefix(self, decode: Any, ticket: KVTicket, prompt: list[int], cache_domain: str) -> None:
        """Count a reservation on blocks the decode worker held; without Redis (no worker publishes)
        record that it will hold this prompt, as `_pick_prefill` does for prefill workers."""
        if ticket.reused_blocks:
            self.decisions["decode_prefix_hits"] += 1
        if ticket.local:
            self.decisions["local_prefills"] += 1
        if self.config.decode_prefix_reuse and not self.config.redis_url:
            hashes = prefix_hashes(prompt, self.config.block_size, self.config.model_name, cache_domain)
            await self.state.publish_blocks(self.ids[id(decode)], hashes, [])

    def _news(self, seen: RepeatFilter, event: TokenEvent) -> TokenEvent | None:
        try:
            return seen.news(event)
        except SpliceError:
            self.decisions["splice_refused"] += 1
            raise

    def _admit(self, request_id: str, num_prompt_tokens: int) -> None:
        """Refuse a new prompt (QueueFullError: 429 with Retry-After) when the prefill pool has more
        than `max_prefill_wait_s` of prompts ahead of it (the prompt tokens admitted and not yet
        prefilled, over the pool's measured throughput): under overload the cluster answers early
        instead of queueing prompts until their leases end (and the decode workers recompute them,
        exactly when they are busiest)."""
        if self.config.mode != Mode.DISAGGREGATED or not self.config.max_prefill_wait_s:
            return
        loads = [self.loads.get(id(handle)) for handle in self._live(self.prefill)]
        rate = sum(load.tokens_per_s for load in loads if load is not None)
        wait_s = sum(self.ahead.values()) / rate if rate > 0 else 0.0  # unknown throughput: admit
        if wait_s > self.config.max_prefill_wait_s:
            self.decisions["refused_overloaded"] += 1
            raise QueueFullError(f"the prefill workers have {wait_s:.1f} s of prompts queued (more than "
                                 f"{self.config.max_prefill_wait_s:g} s): the cluster is overloaded; retry later")
        self.ahead[request_id] = num_prompt_tokens

    async def _wait_for_a_live_worker(self, wanted: Callable[[], bool]) -> None:
        """With no live decode (or colocated) worker, wait for Ray to restart one (the poller takes it
        back once it answers), `worker_wait_s` at most: on a cluster with one decode worker its crash
        then costs its requests time, not their answers. Raises ServiceUnavailable when none came."""
        if self._live(self.decode):
            return
        log.warning("no decode worker is alive: waiting up to %.0f s for one to restart", self.config.worker_wait_s)
        deadline = time.monotonic() + self.config.worker_wait_s
        while not self._live(self.decode) and wanted():
            if time.monotonic() >= deadline:
                raise ServiceUnavailable(f"no decode worker is alive: the last one died and none came back within "
                                         f"{self.config.worker_wait_s:.0f} s; retry later")
            await asyncio.sleep(WAIT_POLL_S)

    async def _disaggregated(self, decode: Any, ticket: KVTicket, request_id: str, prompt: list[int],
                             params: SamplingParams) -> AsyncIterator[TokenEvent]:
        route = self._route(request_id)
        if ticket.local:  # the decode worker computes the prompt's short uncached rest itself
            self.ahead.pop(request_id, None)
            route.chose(prefill_worker="none (local prefill)")
            async for event in self.channels.stream(decode, "stream", request_id, None, route.traceparent):
                yield event
            return
        pick = await self._pick_prefill(prompt, route, params.cache_domain)
        prefill, source = pick.worker, pick.source
        route.chose(prefill_worker=self.ids.get(id(prefill)) if prefill is not None else "none")
        first_token_id: int | None = None  # the prefill's, once relayed: the client has it
        if prefill is None:  # every prefill worker is gone: the decode worker runs the prompt itself
            self.decisions["transfer_failed"] += 1
            await decode.recompute.remote(request_id)
        else:
            key = id(prefill)
            self.queued_tokens[key] = self.queued_tokens.get(key, 0) + pick.work
            if request_id in self.ahead:  # admitted by its whole prompt: what remains is what it computes
                self.ahead[request_id] = pick.work
            fetch_id = ""
            try:
                fetch_id = await self._fetch_prefix(prefill, source, request_id, prompt, params) if source else ""
                async for item in self.channels.stream(prefill, "prefill", request_id, prompt, params, ticket,
                                                       route.traceparent, fetch_id):
                    if isinstance(item, TokenEvent):  # the prefill ends here, the request goes on (decode)
                        if item.token_ids and first_token_id is None:
                            first_token_id = item.token_ids[0]
                        yield replace(item, finished=False, finish_reason=None)
            except Exception as error:  # a failed send or a lost prefill worker: decode recomputes
                if isinstance(error, RayActorError):
                    self._mark_dead(prefill)
                self._warn_transfer_failed(request_id, prefill, decode, ticket.address, error)
                self.decisions["transfer_failed"] += 1
                # After the token the client has, whatever the sampling: never a splice.
                await decode.recompute.remote(request_id, first_token_id)
            finally:
                self.queued_tokens[key] -= pick.work
                self.ahead.pop(request_id, None)  # its prompt is computed (or will not be)
                if fetch_id:  # a prefill that never started holds the fetched blocks pinned: let go
                    control(prefill.release_prefix).remote(fetch_id)
        # The decode worker learns the client's first token, in case the KV is lost after all (its
        # lease ended, it arrived broken): it then recomputes after that token, never a splice.
        async for event in self.channels.stream(decode, "stream", request_id, first_token_id, route.traceparent):
            yield event

    def _warn_transfer_failed(self, request_id: str, prefill: Any, decode: Any, address: str, error: Exception) -> None:
        """Never silent: a recompute costs the prompt twice. The first one after start is most often a
        network problem (a listener that advertises an address the prefill host cannot reach)."""
        source, target = self.ids.get(id(prefill), "prefill"), self.ids.get(id(decode), "decode")
        log.warning("KV of %s from %s to %s at %s failed (%s): %s recomputes the prompt", request_id, source, target,
                    address, error, target)
        if not self.decisions["transfer_failed"]:
            log.warning("first failed KV transfer since start: %s may not reach %s (check that the decode worker "
                        "advertises an address other hosts can reach, see the pool's kv_interface, and that no "
                        "firewall is in between)", source, address)

    @contextlib.contextmanager
    def _holding(self, handle: Any) -> Iterator[None]:
        """Count a request against a decode (or colocated) worker while it is there."""
        self.in_flight[id(handle)] = self.in_flight.get(id(handle), 0) + 1
        try:
            yield
        finally:
            self.in_flight[id(handle)] -= 1

    async def abort(self, request_id: str) -> None:
        """End the request on every worker that may hold it, all at once (each frees its blocks
        between two of its steps)."""
        if request_id in self.attempts:
            self.aborted.add(request_id)
        request_id = self.attempts.get(request_id, request_id)  # a resumed request runs under another id
        results = await asyncio.gather(*(control(handle.abort).remote(request_id)
                                         for handle in self._live(self.prefill + self.decode)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, RayActorError):  # a dead one holds nothing
                raise result
