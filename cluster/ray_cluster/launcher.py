"""Starting and stopping the cluster on Ray: an embedded local Ray by default, or an existing one.

`Cluster.start()` creates the pools of `WorkerActor`s (fractional CPUs so several fit on a small
machine; custom resources pin each pool to its nodes; Ray restarts a dead one) and the `Router`
replicas, and waits until every worker has loaded its model. `generate()` streams a request's
`TokenEvent`s through a router. With `attach` it starts no workers: it routes to those another
cluster listed in the shared registry (Redis), as a second gateway would. With a `name` the workers
are detached: they outlive this process, and the next cluster of that name takes them over.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from cluster.common import env
from cluster.common.errors import ServiceUnavailable
from cluster.common.events import TokenEvent
from cluster.common.loads import WorkerLoad
from cluster.common.roles import Mode, Role
from cluster.common.sampling_params import SamplingParams
from cluster.observability import tracing
from cluster.ray_cluster.channels import Inboxes
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.placement import check_gpu_fit, gpus_per_worker
from cluster.ray_cluster.router import Router, RouterConfig
from cluster.ray_cluster.scaler import Scaler
from cluster.ray_cluster.worker_actor import CONCURRENCY_GROUPS, RAY_NAMESPACE, control
from cluster.ray_cluster.worker_pool import actor_name, make_worker, pool_ranks, worker_engine, worker_spec
from cluster.state.connect import connect_state, redacted_url
from cluster.weights.default_model import resolve_model_path
from cluster.weights.tokenizer import Tokenizer

log = logging.getLogger(__name__)
ROUTER_POLL_S = 1.0  # how often the serving process asks each router replica how it is
START_TIMEOUT_S = 300.0


_temp_dir = ""  # the private local Ray's session files and logs (`init_ray`), removed when it stops


def init_ray(address: str = "") -> None:
    """Join `address`, or start a private local Ray that nothing else can join, by accident or not.

    The local Ray runs with Ray's token authentication and a fresh random token that only this
    process and its children (Ray's own, the workers) have: its ports listen on every interface, and
    whoever could join could run code. No dashboard. RAY_AUTH_MODE=token with RAY_AUTH_TOKEN sets the
    token; any other RAY_AUTH_MODE (an open Ray) is refused unless PDSERVE_ALLOW_OPEN_RAY=1. Joining
    a cluster (`address`) follows that cluster's setting: RAY_AUTH_MODE and RAY_AUTH_TOKEN as its
    nodes have them (disabled when unset).
    """
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if address:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address=address, log_to_driver=False)
        return
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode != "token" and os.environ.get(env.ALLOW_OPEN_RAY) != "1":
        raise RuntimeError(f"RAY_AUTH_MODE={mode} would start the embedded Ray open: whoever reaches its ports "
                           "could run code on it. Unset RAY_AUTH_MODE (pdserve then starts it with a token of its "
                           f"own), or set {env.ALLOW_OPEN_RAY}=1 to accept that")
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        # Ray read its settings when it was imported; read them again, as Ray's own ray.init does
        # when it turns token authentication on (`ray._private.authentication`, checked with 2.60).
        from ray._raylet import Config  # type: ignore[attr-defined]

        Config.initialize("")
    global _temp_dir  # noqa: PLW0603 (one Ray per process: its directory is the process's too)
    _temp_dir = tempfile.mkdtemp(prefix="pdserve-ray-")
    ray.init(address="local", include_dashboard=False, log_to_driver=False, _temp_dir=_temp_dir)
    # After Ray's own exit hook, so it runs first (last in, first out): Ray stopped as `shutdown_ray` stops it,
    # its processes waited for. After Ray's hook, they outlived this process and made the directory again.
    atexit.register(shutdown_ray)


def shutdown_ray(keep_logs: bool = False) -> None:
    """Stop the Ray that `init_ray` started in this process (its processes too) and remove its temporary
    directory (each start makes one: without this, one more under /tmp per start), unless `keep_logs`
    (the tests keep it when some failed: Ray's logs are under session_latest/logs)."""
    import ray

    ray.shutdown()
    _remove_temp_dir(keep_logs)


def _remove_temp_dir(keep: bool = False) -> None:
    """Remove the directory, or forget it."""
    global _temp_dir  # noqa: PLW0603
    if _temp_dir and not keep:
        shutil.rmtree(_temp_dir, ignore_errors=True)
    _temp_dir = ""


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
        self.failures: dict[str, str] = {}  # worker id -> why it cannot serve (failed warm-up)
        self.routers_down: dict[int, str] = {}  # router index -> why (`watch_routers` keeps it)
        self.ids = itertools.count()
        self.turn = itertools.count()
        self.channels = Inboxes()  # one channel to each router replica, all requests' tokens on it
        # Several clusters may share one Ray (benchmarks, tests): unnamed ones name their actors apart.
        self.uid = config.name or uuid.uuid4().hex[:8]
        self.taken_over: list[str] = []  # the named workers this cluster found running and kept
        self.model_name = ""
        self.max_model_len = 0
        self.tokenizer: Tokenizer | None = None
        self.attached: dict[int, tuple[str, str]] = {}  # attach: handle -> (worker id, actor name) listed
        self.scaler: Any = None  # the live controller (`config.scaling`); it holds the pools' handles then

    @property
    def router(self) -> Any:
        """The first router replica (None before start and after stop)."""
        return self.routers[0] if self.routers else None

    def start(self) -> Cluster:
        import ray

        init_ray(self.config.ray_address)
        self._check_gpus()
        colocated = self.config.mode == Mode.COLOCATED
        if self.config.attach:
            self.prefill, self.decode = asyncio.run(self._registered())
        else:
            if not colocated:
                self.prefill = self._pool(Role.PREFILL, self.config.prefill)
            self.decode = self._pool(Role.COLOCATED if colocated else Role.DECODE, self.config.decode)
            if self.config.name:
                self._stop_surplus()
        ray.get([worker.start.remote() for worker in self.prefill + self.decode], timeout=START_TIMEOUT_S)
        # A worker whose warm-up failed keeps the service unready, with its reason (/ready, status).
        loads = ray.get([worker.load.remote() for worker in self.prefill + self.decode], timeout=START_TIMEOUT_S)
        self.failures = {load.worker_id: load.failure for load in loads if load.failure}
        for worker_id, failure in self.failures.items():
            log.error("%s cannot serve: %s", worker_id, failure)
        infos = ray.get([worker.info.remote() for worker in self.prefill + self.decode])
        self.model_name = infos[0][0]
        self.max_model_len = min(max_model_len for _, max_model_len in infos)  # every worker must fit it
        self.tokenizer = Tokenizer.from_dir(resolve_model_path(self.config.engine.model.model))
        # A router that dies is restarted by Ray (its streams end; the gateway refuses nothing meanwhile
        # that another replica can take); max_task_retries=0: a cut stream is not replayed.
        router_class = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0,  # type: ignore[call-overload]
                                  concurrency_groups=CONCURRENCY_GROUPS)(Router)
        router_config = RouterConfig(self.config.mode, self.config.kv_lease_s, self.config.engine.cache.block_size,
                                     self.model_name, self.config.redis_url, self.config.routing,
                                     self.config.worker_wait_s, self.config.max_prefill_wait_s,
                                     self.config.max_decode_wait_s, self.config.tracing,
                                     self.config.decode_prefix_reuse, self.config.local_prefill_threshold,
                                     self.config.prefix_fetch)
        self.routers = [router_class.remote(self._named(Role.PREFILL, self.prefill),
                                            self._named(Role.COLOCATED if colocated else Role.DECODE, self.decode),
                                            router_config)
                        for _ in range(self.config.routers)]
        if self.config.scaling.enabled:
            self._start_scaler()
        return self

    def _start_scaler(self) -> None:
        """The live controller (`cluster.ray_cluster.scaler`): it owns the pools from now on."""
        import ray

        colocated = self.config.mode == Mode.COLOCATED
        role = Role.COLOCATED if colocated else Role.DECODE
        pools = {role: self._named(role, self.decode)}
        if not colocated:
            pools[Role.PREFILL] = self._named(Role.PREFILL, self.prefill)
        gpus = {role: self.gpus_per_worker(self.config.prefill if role == Role.PREFILL else self.config.decode)
                for role in pools}
        # Ray restarts a controller that died; it finds the pools' workers by their names and looks
        # again (`Scaler._recover`). max_task_retries=0: a change cut by its death is not replayed.
        self.scaler = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)(Scaler).remote(  # type: ignore[call-overload]
            self.config, self.uid, self.routers, pools, gpus)

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
        where = redacted_url(self.config.redis_url)  # the URL may carry Redis's password
        raise TimeoutError(f"attach: no {' and '.join(roles)} workers listed in {where} within {START_TIMEOUT_S:.0f} s")

    def _named(self, role: str, handles: list[Any]) -> list[tuple[str, str, Any]]:
        """(worker id, Ray actor name, handle): as the workers were made (`_pool`) or listed."""
        if self.config.attach:
            return [(*self.attached[id(handle)], handle) for handle in handles]
        return [(f"{role}-{index}", self._actor_name(role, index), handle) for index, handle in enumerate(handles)]

    def _actor_name(self, role: str, index: int) -> str:
        return actor_name(self.uid, role, index)

    def gpus_per_worker(self, pool: PoolConfig) -> float:
        """The Ray GPUs each worker of `pool` asks for (`placement.gpus_per_worker`): one GPU each on CUDA
        unless the pool's `num_gpus` says otherwise."""
        import ray

        device = self.config.engine.model.device
        if pool.num_gpus is not None or device == "cpu":
            return gpus_per_worker(device, pool.num_gpus, 0.0, False)
        ray_gpus = float(ray.cluster_resources().get("GPU", 0))
        usable = device != "auto" or not self._local_gpus_unusable()  # _check_gpus says why, at start
        return gpus_per_worker(device, None, ray_gpus, usable)

    def _local_gpus_unusable(self) -> str | None:
        """On the embedded Ray the GPUs Ray sees are this host's: why torch here cannot use them, if it
        cannot (a CPU build, an old driver). Not asked of a Ray cluster's own: its GPU nodes are elsewhere
        (each worker refuses GPUs it cannot use: `worker_actor.refuse_unusable_gpus`)."""
        if self.config.ray_address:
            return None
        from cluster.model.device import cuda_unusable_reason

        return cuda_unusable_reason()

    def _check_gpus(self) -> None:
        """Refuse at start what can never run: CUDA workers on an embedded Ray without GPUs. On a Ray
        cluster of its own an autoscaler may add GPU nodes later: there, a warning."""
        import ray

        pools = [] if self.config.attach else [(Role.COLOCATED, self.config.decode)] \
            if self.config.mode == Mode.COLOCATED else [(Role.PREFILL, self.config.prefill),
                                                        (Role.DECODE, self.config.decode)]
        have = float(ray.cluster_resources().get("GPU", 0))
        if have and self.config.engine.model.device == "auto" and (reason := self._local_gpus_unusable()):
            log.error("Ray sees %g GPU(s) on this host, but %s. --device auto runs every worker on the CPU and "
                      "reserves none of them: install torch's CUDA build or a newer driver to use them, or say "
                      "--device cpu to silence this.", have, reason)
        workers = []
        for role, pool in pools:
            num_gpus = self.gpus_per_worker(pool)
            worker_engine(self.config, role, num_gpus)  # refuses a pool's memory share past its GPU share
            workers += [num_gpus * pool_ranks(self.config, role)] * pool.replicas  # a GPU per rank
        try:
            check_gpu_fit(workers, node_gpus())
        except ValueError as error:
            message = f"{error} (device {self.config.engine.model.device!r})"
            if not self.config.ray_address:
                raise ValueError(message) from None
            log.warning("%s; the workers wait until Ray has them (an autoscaler may add GPU nodes)", message)

    def _pool(self, role: str, pool: PoolConfig) -> list[Any]:
        num_gpus = self.gpus_per_worker(pool)  # asks Ray once per pool, not once per worker
        spec = worker_spec(self.config, role, pool, num_gpus)
        workers = []
        for index in range(pool.replicas):
            running = self._running_worker(self._actor_name(role, index), spec) if self.config.name else None
            workers.append(running if running is not None else make_worker(self.config, self.uid, role, index,
                                                                           num_gpus))
        return workers

    def _running_worker(self, name: str, spec: tuple[Any, ...]) -> Any | None:
        """The named worker a previous gateway of this cluster left running, if it runs as this one
        would make it (`spec`): taken over, its model stays loaded. One made otherwise (the config
        changed) is stopped, to be made again."""
        import ray

        try:
            handle = ray.get_actor(name, namespace=RAY_NAMESPACE)
        except ValueError:
            return None
        with contextlib.suppress(Exception):  # a worker that does not answer is made again
            if ray.get(handle.spec.remote(), timeout=START_TIMEOUT_S) == spec:
                log.info("taking over worker %s (its model stays loaded)", name)
                self.taken_over.append(name)
                return handle
        log.warning("worker %s runs another configuration: stopping it, making it again", name)
        stop_worker(name)
        return None

    def _stop_surplus(self) -> None:
        """Named workers of this cluster beyond its pools now (a gateway before had more): stopped."""
        colocated = self.config.mode == Mode.COLOCATED
        pools = [(Role.COLOCATED if colocated else Role.DECODE, self.config.decode)]
        pools += [] if colocated else [(Role.PREFILL, self.config.prefill)]
        kept = {self._actor_name(role, index) for role, pool in pools for index in range(pool.replicas)}
        for name in named_workers(self.config.name):
            if name not in kept:
                log.warning("stopping worker %s: not in this cluster's pools any more", name)
                stop_worker(name)

    async def generate(self, prompt: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        from ray.exceptions import ActorUnavailableError, RayActorError

        request_id = request_id or f"cluster-{next(self.ids)}"
        up = [index for index in range(len(self.routers)) if index not in self.routers_down]
        start = next(self.turn)
        for index in up[start % len(up):] + up[:start % len(up)] if up else []:
            started = False
            try:
                async for event in self.channels.stream(self.routers[index], "generate", request_id, prompt, params,
                                         tracing.current_traceparent()):
                    started = True
                    yield event
                return
            except (RayActorError, ActorUnavailableError) as error:
                if started:
                    raise  # its tokens went out through that router: the caller sees the cut
                self.routers_down[index] = f"router {index} does not answer ({type(error).__name__})"
                log.warning("router %d does not answer: %s goes to another", index, request_id)
        raise ServiceUnavailable(f"no router answers: {'; '.join(self.routers_down.values())}")

    async def watch_routers(self, every_s: float = ROUTER_POLL_S) -> None:
        """Until cancelled: ask each router replica how it is every `every_s`; one that does not answer
        (dead, or Ray is restarting it) takes no new requests and is reported (`routers_down`), until
        it answers again. The serving process runs this, so readiness follows the routers."""
        while True:
            for index, router in enumerate(self.routers):
                try:
                    await asyncio.wait_for(control(router.stats).remote(), timeout=every_s * 5)
                except Exception as error:
                    if index not in self.routers_down:
                        log.error("router %d does not answer (%s): no requests go to it", index, type(error).__name__)
                    self.routers_down[index] = f"router {index} does not answer ({type(error).__name__})"
                else:
                    if self.routers_down.pop(index, None) is not None:
                        log.warning("router %d answers again", index)
            await asyncio.sleep(every_s)

    async def abort(self, request_id: str) -> None:
        """End a request on every worker (its blocks freed everywhere), whichever router runs it."""
        await asyncio.gather(*(control(router.abort).remote(request_id) for router in self.routers))

    async def router_stats(self) -> dict[str, Any]:
        """Every router replica's decisions and Redis fallbacks, summed, and the scaler's (for /metrics)."""
        decisions: dict[str, int] = {}
        recoveries: dict[str, float] = {}
        fallbacks = 0
        for router in self.routers:
            for decision, count in (await control(router.stats).remote()).items():
                decisions[decision] = decisions.get(decision, 0) + count
            for phase, seconds in (await control(router.recovery_stats).remote()).items():
                recoveries[phase] = recoveries.get(phase, 0.0) + seconds
            fallbacks += await control(router.state_fallbacks).remote()
        stats = {"decisions": decisions, "counters": {"pdserve:router_redis_fallbacks": fallbacks},
                 "recoveries": recoveries}
        return {**stats, "scaling": await self.scaling()} if self.scaler is not None else stats

    async def scaling(self) -> dict[str, Any]:
        """The scaler's pool sizes and decisions (`Scaler.status`); empty when scaling is off or while
        Ray restarts the scaler."""
        if self.scaler is None:
            return {}
        try:
            return await self.scaler.status.remote()
        except Exception as error:  # restarting
            log.warning("the scaler does not answer: %r", error)
            return {}

    async def _handles(self) -> list[Any]:
        """The workers now: the scaler's pools when it runs (it adds and removes), else (scaling off,
        or the scaler restarting) those started."""
        if self.scaler is not None:
            with contextlib.suppress(Exception):
                return list(await self.scaler.handles.remote())
        return self.prefill + self.decode

    async def workers(self) -> list[WorkerLoad]:
        """Each live worker's load; a dead one is left out."""
        loads = []
        for worker in await self._handles():
            with contextlib.suppress(Exception):
                loads.append(await control(worker.load).remote())
        return loads

    def stop(self, workers: bool | None = None) -> None:
        """Stop the routers, and the workers this cluster started (attached ones are another's). A
        named cluster's workers outlive it (the next gateway of that name takes them over) unless
        `workers` is true."""
        import ray

        keep = self.config.attach or (bool(self.config.name) and not workers)
        handles = self.prefill + self.decode
        if self.scaler is not None:  # its pools, the workers it added too
            try:
                handles = ray.get(self.scaler.stop.remote(), timeout=30)
            except Exception:  # it does not answer: the workers are found by their names (those it added are detached)
                handles = [ray.get_actor(name, namespace=RAY_NAMESPACE) for name in named_workers(self.uid)]
            ray.kill(self.scaler)
            self.scaler = None
        for worker in [] if keep else handles:
            with contextlib.suppress(Exception):  # a dead worker needs no stopping
                ray.get(worker.stop.remote(), timeout=30)
            ray.kill(worker)
        for router in self.routers:
            ray.kill(router)
        self.prefill, self.decode, self.routers = [], [], []


def node_gpus() -> list[float]:
    """The GPUs of each live node of the Ray cluster this process joined."""
    import ray

    return [float(node["Resources"].get("GPU", 0)) for node in ray.nodes() if node.get("Alive")]


def named_workers(name: str) -> list[str]:
    """The Ray actor names of the running workers of the cluster called `name`."""
    import ray

    prefix = f"pdserve-{name}-"
    return sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                  if actor["namespace"] == RAY_NAMESPACE and actor["name"].startswith(prefix)
                  and actor["name"].removeprefix(prefix).split("-")[0] in tuple(Role))


def stop_worker(name: str) -> None:
    """Stop a named worker (its requests end, its blocks and listeners go) and end its actor."""
    import ray

    with contextlib.suppress(ValueError):
        handle = ray.get_actor(name, namespace=RAY_NAMESPACE)
        with contextlib.suppress(Exception):  # a dead worker needs no stopping
            ray.get(handle.stop.remote(), timeout=30)
        ray.kill(handle, no_restart=True)
