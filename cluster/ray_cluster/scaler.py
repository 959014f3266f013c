"""The live controller: a Ray actor that grows and shrinks the worker pools while the cluster serves.

Started by the launcher when `scaling.enabled` (docs/deploy.md, Scaling live); from then on it owns
the pools' handles. Every `interval_s` it reads each worker's load, turns each pool's loads into
signals and asks that pool's hysteresis for a decision (`cluster.ray_cluster.scaling_policy`).

Growing a pool: start a worker under the next free index (its model loads), then tell every router
replica to route to it (`Router.add_worker`; with Redis the registry lists it as well).

Shrinking one, its newest worker, by draining, so that no request is lost:
1. every router replica stops sending it new requests (`Router.drain_worker`);
2. the worker refuses new reservations, leaves the registry and finishes what it holds
   (`Worker.drain`), `drain_timeout_s` at most;
3. it is stopped and its actor ended; a request still there past the timeout sees its worker lost,
   and its router resumes it elsewhere after the tokens already sent (the path of any lost worker);
4. every router replica forgets it (`Router.remove_worker`).
One change runs at a time; the looks wait for it. Each decision is logged with its reason and
counted (`status`, exported by /metrics as pdserve:scaling_decisions_total and pdserve:pool_workers).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from cluster.common.loads import WorkerLoad
from cluster.ray_cluster.config import ClusterConfig
from cluster.ray_cluster.scaling_policy import UP, Decision, PoolHysteresis, pool_signals
from cluster.ray_cluster.worker_actor import control
from cluster.ray_cluster.worker_pool import actor_name, make_worker

log = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 5.0


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
        self.drained: list[dict[str, Any]] = []  # each removed worker: emptied in time, its blocks then
        self.changing = asyncio.Lock()
        self.stopped = False

    async def run(self) -> None:
        """Look every `interval_s` until `stop`; a look that fails is logged, and the next one tried."""
        while not self.stopped:
            try:
                await self.look()
            except Exception:
                log.exception("scaling: a look failed")
            await asyncio.sleep(self.config.scaling.interval_s)

    async def look(self) -> None:
        """Read every pool's loads and apply the decisions they call for."""
        for role, workers in self.pools.items():
            loads = await self._loads([handle for _, _, handle in workers])
            signals = pool_signals(role, self.before, loads)
            self.before.update({load.worker_id: load for load in loads})
            decision = self.hysteresis[role].decide(signals, time.monotonic())
            if decision is not None and not self.stopped:
                await self._apply(decision)

    async def scale(self, role: str, direction: str, reason: str = "manual") -> str:
        """Add (`up`) or remove (`down`) one worker of the pool of `role` now, outside the looks (its
        cooldown starts again); the id of the worker added or removed."""
        if role not in self.pools:
            raise ValueError(f"no {role} pool to scale; pools: {sorted(self.pools)}")
        self.hysteresis[role].acted(time.monotonic())
        return await self._apply(Decision(role, direction, reason, "asked"))

    async def _apply(self, decision: Decision) -> str:
        async with self.changing:
            size = len(self.pools[decision.pool])
            log.warning("scaling %s %s from %d workers (%s): %s", decision.pool, decision.direction, size,
                        decision.reason, decision.detail)
            key = (decision.pool, decision.direction, decision.reason)
            self.decisions[key] = self.decisions.get(key, 0) + 1
            worker_id = await (self._add(decision.pool) if decision.direction == UP else self._remove(decision.pool))
            self.last = {"pool": decision.pool, "direction": decision.direction, "reason": decision.reason,
                         "detail": decision.detail, "worker": worker_id, "at": time.time()}
            return worker_id

    async def _add(self, role: str) -> str:
        index = self.next_index[role]
        self.next_index[role] += 1
        worker_id, name = f"{role}-{index}", actor_name(self.uid, role, index)
        handle = make_worker(self.config, self.uid, role, index, self.gpus[role])
        await handle.start.remote()  # its model loaded and warmed up before any request comes
        failure = (await control(handle.load).remote()).failure
        if failure:  # routed to, it would fail requests: ended, and the pool stays as it was
            await self._end(handle)
            raise RuntimeError(f"scaling: the new worker {worker_id} cannot serve: {failure}")
        self.pools[role].append((worker_id, name, handle))
        await asyncio.gather(*(control(router.add_worker).remote(role, worker_id, name) for router in self.routers))
        log.warning("scaling: %s serves (%d %s workers)", worker_id, len(self.pools[role]), role)
        return worker_id

    async def _remove(self, role: str) -> str:
        if len(self.pools[role]) <= 1:
            raise ValueError(f"the {role} pool has one worker left: it is never removed")
        worker_id, _, handle = self.pools[role].pop()  # the newest
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
        log.warning("scaling: %s removed (%d %s workers)", worker_id, len(self.pools[role]), role)
        return worker_id

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
        """Pool sizes and workers, decisions by (pool, direction, reason), the last one, the drained
        workers: plain values, for /v1/workers (`pdserve status`) and /metrics."""
        return {"pools": {role: len(workers) for role, workers in self.pools.items()},
                "workers": {role: [worker_id for worker_id, _, _ in workers] for role, workers in self.pools.items()},
                "decisions": [[*key, count] for key, count in sorted(self.decisions.items())],
                "last": dict(self.last), "drained": list(self.drained)}

    async def handles(self) -> list[Any]:
        """Every worker's handle, the pools' order."""
        return [handle for workers in self.pools.values() for _, _, handle in workers]

    async def stop(self) -> list[Any]:
        """Make no more decisions; the handles of the workers, for the launcher to stop."""
        self.stopped = True
        async with self.changing:  # a change under way ends first
            return await self.handles()
