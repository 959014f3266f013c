"""A worker as a Ray actor: one engine and the UCX connector of its role, in their own process.

Workers are named actors in the fixed Ray namespace `RAY_NAMESPACE`, so any driver (a router
replica, another gateway) can resolve them by the name the registry lists."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from cluster.common.events import TokenEvent
from cluster.common.loads import NO_REUSE, KVTicket, PrefixReuse, TransferStats, WorkerLoad
from cluster.common.roles import Role
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import EngineConfig
from cluster.observability import tracing
from cluster.ray_cluster.channels import ChannelHost
from cluster.state.connect import connect_state
from cluster.state.interface import WorkerInfo
from cluster.transfer.addresses import interface_address
from cluster.worker.cpu_binding import reserve_front_door
from cluster.worker.node_cores import NodeCores, host_cores
from cluster.worker.own_thread import in_own_thread
from cluster.worker.worker import Worker, event_of

log = logging.getLogger(__name__)
T = TypeVar("T")
RAY_NAMESPACE = "pdserve"  # workers' actor names live here, so other drivers (gateway replicas) find them
# Calls that must never wait behind streams (an actor runs at most `max_concurrency` calls at once,
# streams included): aborts, load polls, stats. Workers and routers run them in a group of their own.
CONTROL = "control"
CONCURRENCY_GROUPS = {CONTROL: 64}
EXIT_ENGINE_FAILED = 70  # the exit status of a worker process whose engine thread failed (EX_SOFTWARE)




def control(method: Any) -> Any:
    """An actor method called in the control group: it runs however many streams the actor serves."""
    return method.options(concurrency_group=CONTROL)


def worker_actor_class() -> Any:
    """`WorkerActor` as a Ray actor class, with its control group: every worker is made from this."""
    import ray

    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(WorkerActor)  # type: ignore[call-overload]


def _end_process(error: BaseException) -> None:
    """The engine thread failed (the traceback is logged): end this actor's process, so that Ray
    restarts it (`max_restarts`) and the routers resume its requests elsewhere. A worker alive with
    a dead engine thread would hang every call instead."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_ENGINE_FAILED)


def kv_host(interface: str = "") -> str:
    """The address this node's KV listener advertises: the named interface's, else the node's own
    address as Ray knows it (`ray start --node-ip-address`), which other nodes reach it by."""
    if interface:
        return interface_address(interface)
    import ray

    return str(ray.util.get_node_ip_address())


def refuse_unusable_gpus(device: str) -> None:
    """A worker Ray gave GPUs that torch here cannot use (a CPU build, an old driver) would run on the
    CPU while holding them: refused, with why. A cpu worker holds them as its pool asked."""
    import ray

    gpus = ray.get_gpu_ids()
    if not gpus or device == "cpu":
        return
    from cluster.model.device import cuda_unusable_reason

    if reason := cuda_unusable_reason():
        raise RuntimeError(f"this worker holds Ray GPU(s) {gpus} for device {device!r}, but {reason}: "
                           "install torch's CUDA build or a newer driver on this node, or run with --device cpu")


def node_cores(threads: int, engine_cpus: frozenset[int] | None = None) -> NodeCores | None:
    """How many threads this worker's engine computes on: `threads` fixed, or (0) every core of its
    node that no other busy worker holds, at least its own share of Ray's CPUs; of `engine_cpus`
    alone where cores are kept for the front door."""
    import ray

    if threads > 0:  # the engine thread sets them (torch's count is per thread)
        return None
    context = ray.get_runtime_context()
    node: dict[str, Any] = next((n for n in ray.nodes() if n["NodeID"] == context.get_node_id()), {})
    own = int(context.get_assigned_resources().get("CPU", 1))  # Ray's OMP_NUM_THREADS: its share, at least 1
    total = host_cores(node.get("Resources", {}).get("CPU", 1))
    return NodeCores(min(total, len(engine_cpus)) if engine_cpus else total, own)


class WorkerActor(ChannelHost):
    """The Ray face of `Worker`: builds the engine and the UCX connector inside the actor process.

    The worker starts on its first call, whichever it is: when Ray restarts a dead worker (the actor's
    `max_restarts`) it runs `__init__` again and nothing else, and the routers' next load poll brings
    it back into service."""

    streams = frozenset({"generate", "prefill", "stream"})  # what a router opens on its channel here

    def __init__(self, worker_id: str, role: str, engine_config: EngineConfig, kv_interface: str = "",  # noqa: PLR0913
                 overlap_transfer: bool = True, redis_url: str = "", address: str = "",
                 ucx_transports: str = "", spec: Any = None, traces: tracing.TracingConfig | None = None,
                 threads: int = 0, kv_shared_memory: bool = True, reserved_cpus: int = 0,
                 prefix_fetch: bool = False) -> None:
        # Wall-clock times (the router compares them with its own): when this process began to build
        # the worker, and how long each part of its start took (`startup`).
        self.timings: dict[str, float] = {"init_began": time.time()}
        from cluster.engine.llm_engine import LLMEngine
        from cluster.transfer.ucx import UCXReceiver, UCXSender

        refuse_unusable_gpus(engine_config.model.device)
        # Every thread of this process on the front door's cores but the engine thread (`cpu_binding`).
        split = reserve_front_door(reserved_cpus)
        engine_cpus = split.engines if split is not None else None
        if traces is not None and traces.enabled:
            tracing.configure(traces, f"pdserve-{role}")  # this actor process's own tracer provider
        transports = ucx_transports or None  # UCX_TLS for this worker; None: the environment's, or UCX's default
        host = kv_host(kv_interface)
        # With kv_shared_memory, a prefill and a decode worker on one host pass KV through /dev/shm.
        # Fetching prefixes, prefill workers receive them too, and decode workers send the ones they hold.
        sender = UCXSender(transports=transports, shared_memory=kv_shared_memory) \
            if role == Role.PREFILL or (prefix_fetch and role == Role.DECODE) else None
        receiver = UCXReceiver(host=host, transports=transports, shared_memory=kv_shared_memory) \
            if role == Role.DECODE or (prefix_fetch and role == Role.PREFILL) else None
        state = connect_state(redis_url) if redis_url else None  # without Redis the router keeps its own
        # Loaded on a thread that ends: its OpenMP team must not outlive it (`cluster.worker.own_thread`).
        began = time.perf_counter()
        engine = in_own_thread(lambda: LLMEngine(engine_config))
        self.timings["model_load_s"] = time.perf_counter() - began
        self.made_as = spec  # how the launcher made it: a gateway taking a named worker over compares
        # Router replicas find the worker in the registry by its Ray actor name.
        # The actor id tells routers a new actor under a name they know (a named worker made again).
        import ray

        listing = WorkerInfo(worker_id, role, address or worker_id,
                             {"namespace": RAY_NAMESPACE, "model": engine.model_name, "host": host,
                              "actor_id": ray.get_runtime_context().get_actor_id() or ""})
        self.worker = Worker(worker_id, role, engine, sender=sender, receiver=receiver,
                             overlap_transfer=overlap_transfer, state=state, listing=listing, on_fatal=_end_process,
                             cores=node_cores(threads, engine_cpus), threads=threads, engine_cpus=engine_cpus)
        self.started: asyncio.Task[None] | None = None
        # The event loop the worker lives on: that of Ray's default concurrency group, where the
        # first call of that group starts it. Control calls (`control` group: aborts, load polls)
        # run on another loop, in another thread, and hand their work over to this one.
        self.home: asyncio.AbstractEventLoop | None = None
        self.timings["init_s"] = time.time() - self.timings["init_began"]

    async def _ready(self) -> Worker:
        if self.started is None:
            self.home = asyncio.get_running_loop()
            self.started = self.home.create_task(self._start())
        await asyncio.shield(self.started)
        return self.worker

    async def _start(self) -> None:
        began = time.perf_counter()
        await self.worker.start()
        self.timings["warm_up_s"] = time.perf_counter() - began
        self.timings["serving_since"] = time.time()

    async def startup(self) -> dict[str, float]:
        """When this process began to build the worker (wall clock), and how long it took to build
        (`init_s`, of which `model_load_s`) and to warm up (`warm_up_s`): a recovery's timeline."""
        return dict(self.timings)

    async def _at_home(self, work: Callable[[Worker], Awaitable[T]]) -> T:
        """Run `work(worker)` on the worker's own loop, from whichever loop this call came in on."""
        if self.home is None:
            raise RuntimeError(f"{self.worker.worker_id} is starting")  # a poll: it asks again
        if asyncio.get_running_loop() is self.home:
            return await work(await self._ready())

        async def there() -> T:
            return await work(await self._ready())

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(there(), self.home))

    async def start(self) -> str:
        return (await self._ready()).worker_id

    async def stop(self) -> None:
        if self.started is not None:
            await self.worker.stop()

    async def drain(self, timeout_s: float) -> bool:
        """See `Worker.drain`."""
        return await (await self._ready()).drain(timeout_s)

    async def load(self) -> WorkerLoad:
        return await self._at_home(lambda worker: worker.load())

    async def pool_state(self) -> tuple[int, int]:
        """(free blocks, total blocks): whole when equal and nothing runs."""
        load = await (await self._ready()).load()
        return load.num_free_blocks, load.num_blocks

    async def spec(self) -> Any:
        """What it was made with (the launcher's `spec`)."""
        return self.made_as

    async def info(self) -> tuple[str, int]:
        """(served model name, max_model_len): what the front doors tell users and check prompts by."""
        return self.worker.engine.model_name, self.worker.engine.max_model_len

    async def transfers(self) -> list[TransferStats]:
        return list(self.worker.transfers)

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       trace: str = "") -> AsyncIterator[TokenEvent]:
        worker = await self._ready()
        async for output in worker.generate(request_id, prompt, params, trace):
            yield event_of(output, worker.worker_id)

    async def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,  # noqa: PLR0913
                      ticket: KVTicket, trace: str = "",
                      fetch_id: str = "") -> AsyncIterator[TokenEvent | TransferStats]:
        worker = await self._ready()
        async for item in worker.prefill(request_id, prompt, params, ticket, trace, fetch_id):
            yield item if isinstance(item, TransferStats) else event_of(item, worker.worker_id)

    async def reserve(self, request_id: str, prompt: list[int], params: SamplingParams,
                      lease_s: float, trace: str = "", reuse: PrefixReuse = NO_REUSE) -> KVTicket | None:
        return await (await self._ready()).reserve(request_id, prompt, params, lease_s, trace, reuse)

    async def offer_prefix(self, fetch_id: str, prompt: list[int], cache_domain: str, first_block: int,
                           stop_block: int) -> int:
        return await (await self._ready()).offer_prefix(fetch_id, prompt, cache_domain, first_block, stop_block)

    async def expect_prefix(self, fetch_id: str, prompt: list[int], cache_domain: str, first_block: int,
                            num_blocks: int) -> KVTicket | None:
        return await (await self._ready()).expect_prefix(fetch_id, prompt, cache_domain, first_block, num_blocks)

    async def send_prefix(self, fetch_id: str, ticket: KVTicket) -> TransferStats:
        return await (await self._ready()).send_prefix(fetch_id, ticket)

    async def release_prefix(self, fetch_id: str) -> None:
        await self._at_home(lambda worker: worker.release_prefix(fetch_id))

    async def recompute(self, request_id: str, first_token_id: int | None = None) -> None:
        await (await self._ready()).recompute(request_id, first_token_id)

    async def stream(self, request_id: str, first_token_id: int | None = None,
                     trace: str = "") -> AsyncIterator[TokenEvent]:
        worker = await self._ready()
        async for output in worker.stream(request_id, first_token_id, trace):
            yield event_of(output, worker.worker_id)

    async def abort(self, request_id: str) -> bool:
        return await self._at_home(lambda worker: worker.abort(request_id))

