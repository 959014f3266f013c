"""Starting and stopping the cluster on Ray: an embedded local Ray by default, or an existing one.

`Cluster.start()` creates the pools of `WorkerActor`s (fractional CPUs so several fit on a small
machine; custom resources pin each pool to its nodes; Ray restarts a dead one) and the `Router`
replicas, and waits until every worker has loaded its model. `generate()` streams a request's
`TokenEvent`s through a router. With `attach` it starts no workers: it routes to those another
cluster listed in the shared registry (Redis), as a second gateway would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from cluster.common.events import TokenEvent
from cluster.common.loads import WorkerLoad
from cluster.common.roles import Mode, Role
from cluster.common.sampling_params import SamplingParams
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.router import Router, RouterConfig
from cluster.ray_cluster.worker_actor import RAY_NAMESPACE, WorkerActor
from cluster.state.connect import connect_state
from cluster.weights.default_model import resolve_model_path
from cluster.weights.tokenizer import Tokenizer

START_TIMEOUT_S = 300.0


def init_ray(address: str = "") -> None:
    """Join `address`, or start a private local Ray that nothing else can join by accident."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 _temp_dir=tempfile.mkdtemp(prefix="pdserve-ray-"))


def shutdown_ray() -> None:
    """Stop the Ray that `init_ray` started in this process (its processes too)."""
    import ray

    ray.shutdown()


class Cluster:
    """The launcher: starts (or attaches to) the worker pools and the router replicas on Ray.

    Owns the Ray actor handles of the workers it started and of its routers; stops them on `stop`.
    Called by the serving process (`ServiceLauncher` starts it in a thread, `ClusterService` calls
    `generate`/`abort`/`workers` from the server's event loop), by benchmarks and by the tests; the
    request calls are spread over the router replicas round-robin. Holds no engine itself.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.prefill: list[Any] = []
        self.decode: list[Any] = []
        self.routers: list[Any] = []
        self.ids = itertools.count()
        self.turn = itertools.count()
        self.uid = uuid.uuid4().hex[:8]  # several clusters may share one Ray (benchmarks, tests)
        self.model_name = ""
        self.max_model_len = 0
        self.tokenizer: Tokenizer | None = None
        self.attached: dict[int, tuple[str, str]] = {}  # attach: handle -> (worker id, actor name) listed

    @property
    def router(self) -> Any:
        """The first router replica (None before start and after stop)."""
        return self.routers[0] if self.routers else None

    def start(self) -> Cluster:
        import ray

        init_ray(self.config.ray_address)
        colocated = self.config.mode == Mode.COLOCATED
        if self.config.attach:
            self.prefill, self.decode = asyncio.run(self._registered())
        else:
            if not colocated:
                self.prefill = self._pool(Role.PREFILL, self.config.prefill)
            self.decode = self._pool(Role.COLOCATED if colocated else Role.DECODE, self.config.decode)
        ray.get([worker.start.remote() for worker in self.prefill + self.decode], timeout=START_TIMEOUT_S)
        infos = ray.get([worker.info.remote() for worker in self.prefill + self.decode])
        self.model_name = infos[0][0]
        self.max_model_len = min(max_model_len for _, max_model_len in infos)  # every worker must fit it
        self.tokenizer = Tokenizer.from_dir(resolve_model_path(self.config.engine.model.model))
        router_class = ray.remote(num_cpus=0)(Router)
        router_config = RouterConfig(self.config.mode, self.config.kv_lease_s, self.config.engine.cache.block_size,
                                     self.model_name, self.config.redis_url, self.config.routing)
        self.routers = [router_class.remote(self._named(Role.PREFILL, self.prefill),
                                            self._named(Role.COLOCATED if colocated else Role.DECODE, self.decode),
                                            router_config)
                        for _ in range(self.config.routers)]
        return self

    async def _registered(self) -> tuple[list[Any], list[Any]]:
        """The (prefill, decode) workers listed in the shared registry, once a decode worker is there."""
        import ray

        roles = (Role.COLOCATED,) if self.config.mode == Mode.COLOCATED else (Role.PREFILL, Role.DECODE)
        state = connect_state(self.config.redis_url)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                found: dict[str, list[Any]] = {role: [] for role in roles}
                self.attached = {}
                for info in await state.workers():
                    if info.role in roles:
                        with contextlib.suppress(ValueError):  # listed, but gone
                            handle = ray.get_actor(info.address, namespace=info.meta.get("namespace", RAY_NAMESPACE))
                            found[info.role].append(handle)
                            self.attached[id(handle)] = (info.worker_id, info.address)
                decode = found[roles[-1]]
                if decode and (self.config.mode == Mode.COLOCATED or found[Role.PREFILL]):
                    return found.get(Role.PREFILL, []), decode
                await asyncio.sleep(0.5)
        finally:
            await state.close()
        raise TimeoutError(f"attach: no {' and '.join(roles)} workers listed in {self.config.redis_url} "
                           f"within {START_TIMEOUT_S:.0f} s")

    def _named(self, role: str, handles: list[Any]) -> list[tuple[str, str, Any]]:
        """(worker id, Ray actor name, handle): as the workers were made (`_pool`) or listed."""
        if self.config.attach:
            return [(*self.attached[id(handle)], handle) for handle in handles]
        return [(f"{role}-{index}", self._actor_name(role, index), handle) for index, handle in enumerate(handles)]

    def _actor_name(self, role: str, index: int) -> str:
        return f"pdserve-{self.uid}-{role}-{index}"

    def _pool(self, role: str, pool: PoolConfig) -> list[Any]:
        import ray

        actor_class = ray.remote(WorkerActor)
        workers = []
        for index in range(pool.replicas):
            name = self._actor_name(role, index)
            # max_task_retries=0: a stream cut by a worker's death is the router's to resume, not Ray's
            # to replay from its start.
            options = actor_class.options(num_cpus=pool.num_cpus, resources=dict(pool.resources), name=name,
                                          namespace=RAY_NAMESPACE, max_restarts=self.config.worker_max_restarts,
                                          max_task_retries=0)
            workers.append(options.remote(f"{role}-{index}", role, self.config.engine, redis_url=self.config.redis_url,
                                          overlap_transfer=self.config.kv_overlap, address=name,
                                          kv_interface=pool.kv_interface, ucx_transports=self.config.ucx_transports))
        return workers

    async def generate(self, prompt: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        request_id = request_id or f"cluster-{next(self.ids)}"
        router = self.routers[next(self.turn) % len(self.routers)]
        async for ref in router.generate.options(num_returns="streaming").remote(request_id, prompt, params):
            yield await ref

    async def abort(self, request_id: str) -> None:
        """End a request on every worker (its blocks freed everywhere), whichever router runs it."""
        await asyncio.gather(*(router.abort.remote(request_id) for router in self.routers))

    async def router_stats(self) -> dict[str, Any]:
        """Every router replica's decisions and Redis fallbacks, summed (for /metrics)."""
        decisions: dict[str, int] = {}
        fallbacks = 0
        for router in self.routers:
            for decision, count in (await router.stats.remote()).items():
                decisions[decision] = decisions.get(decision, 0) + count
            fallbacks += await router.state_fallbacks.remote()
        return {"decisions": decisions, "counters": {"pdserve:router_redis_fallbacks": fallbacks}}

    async def workers(self) -> list[WorkerLoad]:
        """Each live worker's load; a dead one is left out."""
        loads = []
        for worker in self.prefill + self.decode:
            with contextlib.suppress(Exception):
                loads.append(await worker.load.remote())
        return loads

    def stop(self) -> None:
        """Stop the routers, and the workers this cluster started (attached ones are another's)."""
        import ray

        for worker in [] if self.config.attach else self.prefill + self.decode:
            with contextlib.suppress(Exception):  # a dead worker needs no stopping
                ray.get(worker.stop.remote(), timeout=30)
            ray.kill(worker)
        for router in self.routers:
            ray.kill(router)
        self.prefill, self.decode, self.routers = [], [], []
