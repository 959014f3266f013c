"""The live controller: a Ray actor that grows and shrinks the worker pools while the cluster serves.

Started by the launcher when `scaling.enabled` (docs/deploy.md, Scaling live); from then on it owns
the pools' handles. Every `interval_s` it reads each worker's load, turns each pool's loads into
signals and asks that pool's hysteresis for a decision (`cluster.ray_cluster.scaling_policy`).

Growing a pool: take one of its warm spares (`scaling.warm_spares`: workers started under the next
free indexes, their models loaded and warmed up, that no router routes to) or, with none ready,
start a worker (its model loads and warms up), then tell every router replica to route to it
(`Router.add_worker`; with Redis the registry lists it as well). After every change the spares are
made up again in the background, within the pool's `max_workers` counting those serving.

Shrinking one, its newest worker, by draining, so that no request is lost:
1. every router replica stops sending it new requests (`Router.drain_worker`);
2. the worker refuses new reservations, leaves the registry and finishes what it holds
   (`Worker.drain`), `drain_timeout_s` at most;
3. it is stopped and its actor ended; a request still there past the timeout sees its worker lost,
   and its router resumes it elsewhere after the tokens already sent (the path of any lost worker);
4. every router replica forgets it (`Router.remove_worker`).
One change runs at a time; the looks wait for it. Each decision is logged with its reason and
counted (`status`, exported by /metrics as pdserve:scaling_decisions_total and pdserve:pool_workers),
with the times of its steps (`phases`: the signal passing its target, the decision, the actor made,
its model loaded, warmed up, routed to) so that what a new worker costs before it serves shows.
The decisions are checkpointed in Ray's GCS key-value store when made, when their worker is known
and when done, so that a controller Ray restarts counts on from its predecessor's (`_restore`), a
change it was killed in the middle of included (listed with `interrupted`, finished by `_settle`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any

from cluster.common.loads import WorkerLoad
from cluster.ray_cluster.config import ClusterConfig
from cluster.ray_cluster.scaling_policy import UP, Decision, PoolHysteresis, pool_signals
from cluster.ray_cluster.worker_actor import RAY_NAMESPACE, control
from cluster.ray_cluster.worker_pool import actor_name, make_worker

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 5.0
START_TIMEOUT_S = 120.0  # a worker's model load and warm-up
HISTORY = 100  # decisions kept for `status`


class Scaler:
    """Owns the pools (role -> [(worker id, Ray actor name, handle)]), each pool's hysteresis, the
    loads of its last look and the decisions made. Called by the launcher (`run`, `status`,
    `handles`, `stop`) and by an operator or a test (`scale`)."""

    def __init__(self, config: ClusterConfig, uid: str, routers: list[Any],
                 pools: dict[str, list[tuple[str, str, Any]]], gpus: dict[str, float]) -> None:
        self.config, self.uid, self.routers, self.gpus = config, uid, routers, gpus
        self.pools = {role: list(workers) for role, workers in pools.items()}
        self.next_index = {role: len(workers) for role, workers in pools.items()}
        self.hysteresis = {role: PoolHysteresis(role, config.scaling) for role in pools}
        self.before: dict[str, WorkerLoad] = {}  # each worker's load at the last look
        self.decisions: dict[tuple[str, str, str], int] = {}  # (pool, direction, reason) -> count
        self.last: dict[str, Any] = {}  # the last decision, as `pdserve status` shows it
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)  # the latest decisions, oldest first
        self.drained: list[dict[str, Any]] = []  # each removed worker: emptied in time, its blocks then
        self.under_way: dict[str, Any] | None = None  # the decision being applied, for a successor to see
        self.spares: dict[str, list[tuple[tuple[str, str, Any], dict[str, float]]]] = {role: [] for role in pools}
        self.starting: dict[str, dict[str, Any]] = {role: {} for role in pools}  # worker id -> handle (None: not made)
        self.spare_tasks: dict[str, set[asyncio.Task[None]]] = {role: set() for role in pools}
        self.changing = asyncio.Lock()
        self.stopped = False
        self.looks = 0
        self.restarted = _reconstructed()
        if self.restarted:
            self._recover()
            self._restore()
        # Ray runs an async actor's __init__ on its event loop (checked with Ray 2.60): the looks start
        # with the actor, so that an actor Ray restarts looks again with nobody to ask it.
        self.running = asyncio.get_running_loop().create_task(self.run())

    def _recover(self) -> None:
        """After Ray restarted this actor (its constructor's pools are those at the cluster's start):
        the pools are the workers of this cluster alive now, found by their actor names, and the
        pools are left alone for a cooldown, the time of the last decision being unknown. Workers the
        previous one left half added or half drained are settled by the first look (`_settle`)."""
        import ray

        for role in self.pools:
            names = live_workers(self.uid, role)
            self.pools[role] = [(f"{role}-{index}", name, ray.get_actor(name, namespace=RAY_NAMESPACE))
                                for index, name in sorted(names.items())]
            self.next_index[role] = max(names, default=-1) + 1
            self.hysteresis[role].acted(time.monotonic())
        log.warning("scaling: the controller restarted; pools found: %s",
                    {role: [worker_id for worker_id, _, _ in workers] for role, workers in self.pools.items()})

    def _restore(self) -> None:
        """After a restart: the decisions counted and kept by the predecessor (`_checkpoint`), so that
        the counters go on rather than start again from 0."""
        saved = _kv_get(self._checkpoint_key())
        if saved is None:
            return
        self.decisions = {(pool, direction, reason): count for pool, direction, reason, count in saved["decisions"]}
        self.history.extend(saved["history"])
        self.last, self.drained = saved["last"], saved["drained"]
        if saved.get("under_way"):  # the predecessor died applying it: its worker is settled by the first look
            self.last = {**saved["under_way"], "interrupted": True}
            self.history.append(self.last)
            self._checkpoint()

    def _checkpoint(self) -> None:
        """Keep the decisions (counts, history, drained workers) in Ray's GCS key-value store, as Ray
        Serve's controller keeps its state there: it outlives this actor, and a restarted one reads it."""
        _kv_put(self._checkpoint_key(), {"decisions": [[*key, count] for key, count in self.decisions.items()],
                                         "history": list(self.history), "last": self.last, "drained": self.drained,
                                         "under_way": self.under_way})

    def _checkpoint_key(self) -> str:
        return f"pdserve-{self.uid}-scaler"

    async def _settle(self) -> None:
        """Finish what a restarted controller's predecessor left under way: a worker that drains is
        removed, every other one is warmed up (one the predecessor was starting) and routed to by every
        router (a worker added but not yet routed to)."""
        for role, workers in self.pools.items():
            for worker_id, name, handle in list(workers):
                try:
                    await asyncio.wait_for(handle.start.remote(), START_TIMEOUT_S)
                    load = await asyncio.wait_for(control(handle.load).remote(), LOAD_TIMEOUT_S)
                except Exception as error:  # restarting: Ray brings it back, and its routers know it
                    log.warning("scaling: %s does not answer (%r): kept in its pool", worker_id, error)
                    continue
                if load.draining:
                    workers.remove((worker_id, name, handle))
                    await self._drain_out(worker_id, handle)
                else:
                    await asyncio.gather(*(control(router.add_worker).remote(role, worker_id, name)
                                           for router in self.routers))

    async def run(self) -> None:
        """Look every `interval_s` until `stop`; a look that fails is logged, and the next one tried."""
        if self.restarted:
            async with self.changing:
                await self._settle()
        self._top_up()
        while not self.stopped:
            try:
                await self.look()
            except Exception:
                log.exception("scaling: a look failed")
            await asyncio.sleep(self.config.scaling.interval_s)

    async def look(self) -> None:
        """Read every pool's loads and apply the decisions they call for."""
        self.looks += 1
        for role, workers in self.pools.items():
            loads = await self._loads([handle for _, _, handle in workers])
            signals = pool_signals(role, self.before, loads)
            self.before.update({load.worker_id: load for load in loads})
            now = time.monotonic()
            decision = self.hysteresis[role].decide(signals, now)
            if decision is not None and not self.stopped:
                await self._apply(decision, signal_at=time.time() - (now - decision.since))

    async def scale(self, role: str, direction: str, reason: str = "manual") -> str:
        """Add (`up`) or remove (`down`) one worker of the pool of `role` now, outside the looks (its
        cooldown starts again); the id of the worker added or removed."""
        if role not in self.pools:
            raise ValueError(f"no {role} pool to scale; pools: {sorted(self.pools)}")
        self.hysteresis[role].acted(time.monotonic())
        return await self._apply(Decision(role, direction, reason, "asked"), signal_at=time.time())

    async def _apply(self, decision: Decision, signal_at: float) -> str:
        async with self.changing:
            size = len(self.pools[decision.pool])
            log.warning("scaling %s %s from %d workers (%s): %s", decision.pool, decision.direction, size,
                        decision.reason, decision.detail)
            key = (decision.pool, decision.direction, decision.reason)
            self.decisions[key] = self.decisions.get(key, 0) + 1
            decided = time.time()
            phases: dict[str, Any] = {"signal_at": signal_at, "decided_at": decided}
            self.under_way = {"pool": decision.pool, "direction": decision.direction, "reason": decision.reason,
                              "detail": decision.detail, "worker": None, "at": decided}
            self._checkpoint()
            try:
                if decision.direction == UP:
                    worker_id = await self._add(decision.pool, phases)
                else:
                    worker_id = await self._remove(decision.pool)
            finally:
                self.under_way = None
            self.last = {"pool": decision.pool, "direction": decision.direction, "reason": decision.reason,
                         "detail": decision.detail, "worker": worker_id, "at": decided, "done_at": time.time(),
                         "phases": phases}
            self.history.append(self.last)
            self._checkpoint()
            self._top_up()
            return worker_id

    async def _add(self, role: str, phases: dict[str, Any]) -> str:
        """Route to a spare of the pool (one still warming up is waited for) or to a worker started
        now; its steps' times go into `phases`."""
        spare = await self._ready_spare(role)
        if spare is None:
            worker_id = self._next_id(role)
            self._under_way_worker(worker_id)
            member, started = await self._start(role, worker_id)
            phases.update(started, spare=False)
        else:
            member, started = spare
            self._under_way_worker(member[0])
            phases.update(started, spare=True)
        worker_id, name, _ = member
        self.pools[role].append(member)
        await asyncio.gather(*(control(router.add_worker).remote(role, worker_id, name) for router in self.routers))
        phases["routed_at"] = time.time()
        log.warning("scaling: %s serves (%d %s workers; %s)", worker_id, len(self.pools[role]), role,
                    "a warm spare" if spare else f"started in {phases['routed_at'] - phases['decided_at']:.1f} s")
        return worker_id

    def _under_way_worker(self, worker_id: str) -> None:
        """The decision under way has its worker: checkpointed before the pools change."""
        if self.under_way is not None:
            self.under_way["worker"] = worker_id
            self._checkpoint()

    def _next_id(self, role: str) -> str:
        """Take the pool's next free index: the id of the worker about to start (listed as starting)."""
        worker_id = f"{role}-{self.next_index[role]}"
        self.next_index[role] += 1
        self.starting[role][worker_id] = None
        return worker_id

    async def _start(self, role: str, worker_id: str) -> tuple[tuple[str, str, Any], dict[str, float]]:
        """Start the worker `worker_id` (from `_next_id`) and wait until it can serve: its member of a
        pool and when its actor was made, its model loaded and its warm-up done. One that cannot serve
        is ended (routed to, it would fail requests)."""
        index = int(worker_id.rsplit("-", 1)[1])
        name = actor_name(self.uid, role, index)
        try:
            made = time.time()
            handle = self.starting[role][worker_id] = make_worker(self.config, self.uid, role, index, self.gpus[role],
                                                                  detached=True)
            await handle.spec.remote()  # answered once its constructor ran: the model is loaded
            loaded = time.time()
            await handle.start.remote()  # warmed up
            failure = (await control(handle.load).remote()).failure
        finally:
            self.starting[role].pop(worker_id, None)
        if failure:
            await self._end(handle)
            raise RuntimeError(f"scaling: the new worker {worker_id} cannot serve: {failure}")
        return (worker_id, name, handle), {"made_at": made, "loaded_at": loaded, "warmed_at": time.time()}

    async def _ready_spare(self, role: str) -> tuple[tuple[str, str, Any], dict[str, float]] | None:
        """A warm spare of the pool, waiting for one still starting (it is further on than a worker
        started now); None when there is none."""
        while not self.spares[role] and self.spare_tasks[role]:
            await asyncio.wait(set(self.spare_tasks[role]), return_when=asyncio.FIRST_COMPLETED)
        return self.spares[role].pop(0) if self.spares[role] else None

    def _top_up(self) -> None:
        """Start spares in the background until each pool has `warm_spares` ready or starting, with no
        more workers serving, spare and starting than its `max_workers`."""
        for role, workers in self.pools.items():
            bound = self.config.scaling.bounds(role).max_workers
            while not self.stopped and len(self.spares[role]) + len(self.spare_tasks[role]) \
                    < self.config.scaling.warm_spares and \
                    len(workers) + len(self.spares[role]) + len(self.starting[role]) < bound:
                task = asyncio.get_running_loop().create_task(self._warm_spare(role, self._next_id(role)))
                self.spare_tasks[role].add(task)
                task.add_done_callback(self.spare_tasks[role].discard)

    async def _warm_spare(self, role: str, worker_id: str) -> None:
        try:
            spare = await self._start(role, worker_id)
        except Exception:  # the next change tries again
            log.exception("scaling: the spare %s did not start", worker_id)
            return
        self.spares[role].append(spare)
        log.warning("scaling: %s is a warm spare of the %s pool (started in %.1f s)", worker_id, role,
                    spare[1]["warmed_at"] - spare[1]["made_at"])

    async def _remove(self, role: str) -> str:
        if len(self.pools[role]) <= 1:
            raise ValueError(f"the {role} pool has one worker left: it is never removed")
        worker_id, _, handle = self.pools[role].pop()  # the newest
        self._under_way_worker(worker_id)
        await self._drain_out(worker_id, handle)
        log.warning("scaling: %s removed (%d %s workers)", worker_id, len(self.pools[role]), role)
        return worker_id

    async def _drain_out(self, worker_id: str, handle: Any) -> None:
        """Drain a worker already out of its pool, end it, and have every router forget it."""
        await asyncio.gather(*(control(router.drain_worker).remote(worker_id) for router in self.routers))
        emptied = await handle.drain.remote(self.config.scaling.drain_timeout_s)
        free, total = await handle.pool_state.remote()
        if not emptied:
            log.warning("scaling: %s still held requests after %.0f s: they resume on other workers", worker_id,
                        self.config.scaling.drain_timeout_s)
        await self._end(handle)
        await asyncio.gather(*(control(router.remove_worker).remote(worker_id) for router in self.routers))
        self.before.pop(worker_id, None)
        self.drained.append({"worker": worker_id, "emptied": emptied, "free_blocks": free, "blocks": total})

    @staticmethod
    async def _end(handle: Any) -> None:
        import ray

        try:
            await asyncio.wait_for(handle.stop.remote(), LOAD_TIMEOUT_S)
        except Exception as error:  # it is ended anyway
            log.warning("scaling: a drained worker did not stop cleanly: %r", error)
        ray.kill(handle, no_restart=True)

    @staticmethod
    async def _loads(handles: list[Any]) -> list[WorkerLoad]:
        """The loads of the workers that answer (one restarting or dead is left out of this look)."""
        answers = await asyncio.gather(*(asyncio.wait_for(control(handle.load).remote(), LOAD_TIMEOUT_S)
                                         for handle in handles), return_exceptions=True)
        return [answer for answer in answers if isinstance(answer, WorkerLoad)]

    async def status(self) -> dict[str, Any]:
        """Pool sizes and workers, decisions by (pool, direction, reason), the last one and the latest
        `HISTORY` (each with `at`, when it was made, and `done_at`, when its worker served or ended),
        the drained workers: plain values, for /v1/workers (`pdserve status`) and /metrics."""
        return {"pools": {role: len(workers) for role, workers in self.pools.items()},
                "workers": {role: [worker_id for worker_id, _, _ in workers] for role, workers in self.pools.items()},
                "spares": {role: [member[0] for member, _ in spares] for role, spares in self.spares.items()},
                "starting": {role: sorted(starting) for role, starting in self.starting.items()},
                "decisions": [[*key, count] for key, count in sorted(self.decisions.items())],
                "last": dict(self.last), "history": list(self.history), "drained": list(self.drained),
                "looks": self.looks, "restarted": self.restarted}

    async def handles(self) -> list[Any]:
        """Every serving worker's handle, the pools' order."""
        return [handle for workers in self.pools.values() for _, _, handle in workers]

    async def stop(self) -> list[Any]:
        """Make no more decisions; the handles of the workers, spares and those starting too, for the
        launcher to stop."""
        self.stopped = True
        async with self.changing:  # a change under way ends first
            _kv_put(self._checkpoint_key(), None)  # stopped on purpose: the next controller of this name starts anew
            spares = [member[2] for pool_spares in self.spares.values() for member, _ in pool_spares]
            starting = [handle for pool_starting in self.starting.values() for handle in pool_starting.values()
                        if handle is not None]
            return await self.handles() + spares + starting


def _kv_put(key: str, value: Any) -> None:
    """Store `value` (JSON) under `key` in Ray's GCS key-value store (None: delete it); nothing
    outside an actor (no Ray)."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return
    if value is None:
        internal_kv._internal_kv_del(key, namespace=RAY_NAMESPACE)
    else:
        internal_kv._internal_kv_put(key, json.dumps(value), overwrite=True, namespace=RAY_NAMESPACE)


def _kv_get(key: str) -> Any:
    """What `_kv_put` stored under `key`; None when nothing is."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return None
    stored = internal_kv._internal_kv_get(key, namespace=RAY_NAMESPACE)
    return json.loads(stored) if stored else None


def _reconstructed() -> bool:
    """Whether Ray restarted this actor (False outside an actor)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed


def live_workers(uid: str, role: str) -> dict[int, str]:
    """The Ray actor names of the live workers of the pool of `role` in the cluster `uid`, by index."""
    import ray

    prefix = actor_name(uid, role, 0).removesuffix("0")
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
             if actor["namespace"] == RAY_NAMESPACE and actor["name"].startswith(prefix)]
    return {int(name.removeprefix(prefix)): name for name in names if name.removeprefix(prefix).isdigit()}
