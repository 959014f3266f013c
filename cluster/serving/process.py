"""The serving process: the cluster (or one local engine) behind both front doors, until a signal.

    pdserve serve [--config cluster.yaml] [--host 0.0.0.0] [--port 8000] [--grpc-port 50051]
                  [--metrics-port 8081] [--api-key K]

Two kinds of clients, two kinds of port. The API port (and gRPC) is for clients, through an Ingress:
the OpenAI API, /health, /ready. The operator port (`--metrics-port`, off by default, as in vLLM) is
for the cluster's own Prometheus and kubelet: /metrics, /health, /ready with its reasons, and
/v1/workers (`pdserve status`). With it, the API port serves none of these operator endpoints and
its /ready says only whether the server is ready, not why not. Without it, they are all on the API
port. Either way a scrape's fan-out to the workers (Ray calls) is made at most once per `FAN_OUT_S`.

Order matters for operators: the HTTP and gRPC servers listen first, answering /health (alive) and
503 on /ready and on requests while the workers load the model (a minute on a cold cache); then
the cluster starts and the service turns ready.

On SIGTERM (or SIGINT) both doors drain at once, for at most `--drain-s` seconds: the gateway keeps
its socket open but answers new requests and /ready with 503 (a load balancer that still sends
some gets a status to retry elsewhere, not a refused connection), the gRPC server refuses new
calls and reports NOT_SERVING, and the requests already running, streams included, go on to their
end. Then the HTTP server closes, cancelling (so aborting) whatever outlived the drain, and the
cluster stops. A second signal cuts the drain short. `serve` takes the signals itself, not uvicorn,
which would close its socket at once and, re-raising the signal when done, skip the cluster's stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from cluster.common import env
from cluster.common.errors import ServiceUnavailable
from cluster.common.events import TokenEvent
from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.common.throttled import Throttled
from cluster.observability.metrics import CONTENT_TYPE, FAN_OUT_S, ClusterMetrics
from cluster.ray_cluster.config import ClusterConfig
from cluster.ray_cluster.launcher import Cluster, shutdown_ray
from cluster.serving.api_keys import ApiKeys
from cluster.serving.cache_domains import DEFAULT_ISOLATION
from cluster.serving.cluster_service import ClusterService
from cluster.serving.connection_limits import ConnectionLimits
from cluster.serving.local_service import LocalService
from cluster.serving.metered_service import MeteredService
from cluster.serving.off_loop import OffLoop
from cluster.serving.rate_limits import RateLimits
from cluster.serving.request_limits import RequestLimits
from cluster.serving.service import Service
from cluster.serving.tools.template import ToolServing
from cluster.state.connect import connect_state
from cluster.state.interface import SharedState
from cluster.weights.tokenizer import Tokenizer
from cluster.worker.cpu_binding import reserve_front_door

if TYPE_CHECKING:
    from cluster.serving.grpc.server import GrpcServer
    from cluster.serving.http.gateway import Gateway, HttpServer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50051  # 0 picks a free port; -1 turns gRPC off
    metrics_port: int = -1  # the operator port (/metrics, probes, /v1/workers); 0 picks one; -1: on the API port
    api_key: str | None = None  # None: $PDSERVE_API_KEY, if set
    api_keys_file: str = ""  # more keys, one tenant each (cluster.serving.api_keys); with or without api_key
    trusted_proxies: str = ""  # whose X-Forwarded-For the gateway believes (addresses, networks); "": nobody
    tls_cert: str = ""  # PEM certificate (chain) file: both doors serve TLS (HTTPS, gRPC over TLS)
    tls_key: str = ""  # its private key file
    drain_s: float = 30.0
    redis_url: str = ""  # the rate limits' buckets (shared by gateway replicas); empty: this process's
    rate_limit_rps: float = 0.0  # requests per second per API key; 0: none
    rate_limit_tpm: float = 0.0  # prompt + max tokens per minute per API key; 0: none
    request_limits: RequestLimits = field(default_factory=RequestLimits)  # both doors: what one request may ask
    connections: ConnectionLimits = ConnectionLimits()  # both doors: what one connection may hold, how long
    tools: ToolServing = ToolServing()  # both doors: the model's tool call format, whether tool_choice none shows tools
    prefix_cache_isolation: str = DEFAULT_ISOLATION  # both doors: whether API keys share prefix-cache blocks


class DeferredService:
    """A `Service` whose backend is still starting: not ready (so 503) until `attach` gives it one.
    The front doors can listen, and report health, while the workers load the model."""

    def __init__(self, model_name: str, tokenizer: Tokenizer) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = 0
        self.backend: Service | None = None

    def attach(self, backend: Service) -> None:
        self.max_model_len = backend.max_model_len
        self.backend = backend

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.backend.ready

    @property
    def problem(self) -> str:
        return self.backend.problem if self.backend is not None else ""

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[TokenEvent]:
        if self.backend is None:
            raise ServiceUnavailable("the workers are still loading the model")
        async for event in self.backend.generate(prompt, params, request_id):
            yield event

    async def abort(self, request_id: str) -> None:
        if self.backend is not None:
            await self.backend.abort(request_id)

    async def workers(self) -> list[WorkerLoad]:
        return await self.backend.workers() if self.backend is not None else []


class ServiceLauncher:
    """What runs behind the front doors: the Ray cluster, or with `local` one engine in this process."""

    def __init__(self, config: ClusterConfig, local: bool = False) -> None:
        self.config, self.local = config, local
        self.cluster: Cluster | None = None
        self.local_service: LocalService | None = None
        self.router_watch: asyncio.Task[None] | None = None

    def describe(self) -> str:
        if self.local:
            return "one local engine (no Ray)"
        where = f"Ray at {self.config.ray_address}" if self.config.ray_address else "an embedded local Ray"
        return (f"a {self.config.mode} cluster ({self.config.prefill.replicas} prefill, "
                f"{self.config.decode.replicas} decode) on {where}")

    async def start(self) -> Service:
        """Load the model everywhere (in a thread: Ray and the weights block) and return the service.
        With `reserved_cpus`, this process and all it starts first move to the front door's cores."""
        split = reserve_front_door(self.config.reserved_cpus)
        if self.local:
            self.local_service = await asyncio.to_thread(LocalService.from_config, self.config.engine,
                                                         split.engines if split is not None else None)
            return await self.local_service.start()
        self.cluster = await asyncio.to_thread(Cluster(self.config).start)
        self.router_watch = asyncio.create_task(self.cluster.watch_routers())  # readiness follows them
        return ClusterService(self.cluster)

    async def counters(self) -> dict[str, Any]:
        """The router's decisions, for /metrics (none for a local engine)."""
        if self.cluster is None or self.cluster.router is None:
            return {}
        return await self.cluster.router_stats()

    async def scaling(self) -> dict[str, Any]:
        """The live controller's pools and last decision, for `pdserve status` (empty when it is off)."""
        return await self.cluster.scaling() if self.cluster is not None else {}

    async def stop(self) -> None:
        """Stop whatever started; safe to call twice."""
        if self.local_service is not None:
            await self.local_service.stop()
            self.local_service = None
        if self.router_watch is not None:
            self.router_watch.cancel()
            self.router_watch = None
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
            self.cluster = None
            if not self.config.ray_address:  # the embedded Ray is ours: stop its processes too
                await asyncio.to_thread(shutdown_ray)


async def serve(service: DeferredService, backend: ServiceLauncher, options: ServeOptions,
                on_listening: Callable[[str, int | None, str | None], None] | None = None) -> None:
    """Listen, start the backend, serve until a signal (or the HTTP server stops), then drain both
    front doors and stop it all."""
    from cluster.serving.grpc.server import GrpcServer
    from cluster.serving.http.gateway import HttpServer, build_app, gateway_of

    if options.tools.exclude_tools_when_tool_choice_none:
        log.info("tool_choice none leaves a request's tools out of its prompt")
    metrics = gateway_metrics(service.model_name, backend.config)
    state = connect_state(options.redis_url)
    metrics.sources.append(backend.counters)
    metrics.sources.append(lambda: _state_counters(state))
    metered = MeteredService(service, metrics.requests)  # both front doors: every request is timed
    limits = RateLimits(state, options.rate_limit_rps, options.rate_limit_tpm)
    off_loop = OffLoop()  # one pool for both doors' tokenizing and formatting
    api_keys = ApiKeys.of(options.api_key if options.api_key is not None else os.environ.get(env.API_KEY) or None,
                          options.api_keys_file or None)
    app = build_app(metered, api_key=api_keys, limits=limits, request_limits=options.request_limits,
                    off_loop=off_loop, stream_write_timeout_s=options.connections.stream_write_timeout_s,
                    tool_call_parser=options.tools.parser,
                    exclude_tools_when_tool_choice_none=options.tools.exclude_tools_when_tool_choice_none,
                    prefix_cache_isolation=options.prefix_cache_isolation)
    log.info("prefix cache isolation: %s", gateway_of(app).prefix_cache_isolation)
    operator_app = route_operator_endpoints(app, metrics, metered, options.metrics_port >= 0, backend.scaling)
    tls = (options.tls_cert, options.tls_key) if options.tls_cert else None
    http = HttpServer(app, options.host, options.port, graceful_shutdown_s=options.drain_s,
                      trusted_proxies=options.trusted_proxies, tls=tls, connections=options.connections)
    http.server = SignalFreeUvicorn(http.config)
    await http.start()
    shutdown = Shutdown()
    shutdown.install()
    grpc = operator = None
    try:
        if operator_app is not None:
            operator = await _start_operator_port(operator_app, options.host, options.metrics_port, tls)
        if options.grpc_port >= 0:
            grpc_tls = (Path(tls[0]).read_bytes(), Path(tls[1]).read_bytes()) if tls else None
            grpc = GrpcServer(metered, options.host, options.grpc_port, api_key=api_keys, tls=grpc_tls, limits=limits,
                              request_limits=options.request_limits, off_loop=off_loop,
                              connections=options.connections, tools=options.tools,
                              prefix_cache_isolation=options.prefix_cache_isolation)
            await grpc.start()
        if on_listening is not None:
            on_listening(http.url, grpc.port if grpc is not None else None, operator.url if operator else None)
        service.attach(await backend.start())
        shutdown.retake()
        log.info("ready: serving %s", service.model_name)
        await _first_of(shutdown.requested.wait(), http.wait())
    finally:
        await drain(gateway_of(app), http, grpc, options.drain_s, shutdown.hurried)
        if operator is not None:  # after the drain: its /ready reports it to the end
            await operator.stop()
        await backend.stop()
        await state.close()
        off_loop.close()
        shutdown.uninstall()


async def _start_operator_port(app: Any, host: str, port: int, tls: tuple[str, str] | None) -> HttpServer:
    """The operator port's server (with the API's certificate, if any), signals left to `serve`."""
    from cluster.serving.http.gateway import HttpServer

    server = HttpServer(app, host, port, graceful_shutdown_s=1, tls=tls, name="operator port")
    server.server = SignalFreeUvicorn(server.config)
    await server.start()
    return server


async def drain(gateway: Gateway, http: HttpServer, grpc: GrpcServer | None, drain_s: float,
                hurried: asyncio.Event) -> None:
    """Stop taking requests at both doors at once and give those running `drain_s` seconds (less
    once `hurried` is set) to end; then close the HTTP server, cancelling what is left."""
    deadline = time.monotonic() + drain_s
    gateway.start_draining()
    log.info("draining for up to %gs: %d HTTP requests open", drain_s, len(gateway.runs))
    grpc_stopped = asyncio.create_task(grpc.stop(drain_s)) if grpc is not None else None
    await _first_of(gateway.drain(drain_s), hurried.wait())
    if gateway.runs:
        log.warning("drain over with %d HTTP requests still open: cancelling them", len(gateway.runs))
        http.config.timeout_graceful_shutdown = 0  # uvicorn cancels them at once (and says so)
    else:  # answers still on their way out (and requests just past admission) get the rest of the drain
        remaining = 1 if hurried.is_set() else math.ceil(deadline - time.monotonic())
        http.config.timeout_graceful_shutdown = max(1, remaining)
    await http.stop()
    if grpc is not None and grpc_stopped is not None:
        if hurried.is_set():
            await grpc.stop(0)  # a shorter grace overrides the first one's
        await grpc_stopped


class SignalFreeUvicorn(uvicorn.Server):
    """uvicorn without its own SIGINT/SIGTERM handlers: `serve` takes the signals (see above)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Shutdown:
    """SIGTERM and SIGINT, taken on the event loop: the first asks for a drain, a second hurries it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.hurried = asyncio.Event()
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        """Take the signals, when this is the main thread (elsewhere the caller stops `serve`)."""
        loop = asyncio.get_running_loop()
        for number in self.SIGNALS:
            previous = signal.getsignal(number)
            try:
                loop.add_signal_handler(number, self._on_signal, number)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            self.previous[number] = previous

    def retake(self) -> None:
        """Take the signals again once the backend started: Ray's core worker installs its own handler
        of fatal signals, SIGTERM included, which prints every thread's native stack before passing the
        signal on. Installed again, ours is the one that runs: one log line, then the drain. (Ray's
        handler still reports SIGSEGV and SIGABRT.)"""
        loop = asyncio.get_running_loop()
        for number in self.previous:
            loop.add_signal_handler(number, self._on_signal, number)

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for number, previous in self.previous.items():
            loop.remove_signal_handler(number)
            signal.signal(number, previous)
        self.previous.clear()

    def _on_signal(self, number: int) -> None:
        name = signal.Signals(number).name
        if self.requested.is_set():
            log.warning("%s again: cutting the drain short", name)
            self.hurried.set()
        else:
            log.info("%s: stopping", name)
            self.requested.set()


async def _first_of(*awaitables: Awaitable[Any]) -> None:
    """Wait until one of `awaitables` is done (raising its error, if any); cancel the others."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    for task in done:
        task.result()


async def _state_counters(state: SharedState) -> dict[str, Any]:
    """Calls to Redis answered by a fallback (rate limits failed open) in this gateway."""
    fallbacks = getattr(state, "fallbacks", None)
    return {"counters": {"pdserve:gateway_redis_fallbacks": sum(fallbacks.values())}} if fallbacks is not None else {}


def gateway_metrics(model_name: str, config: ClusterConfig) -> ClusterMetrics:
    """This gateway's /metrics. An attached gateway serves another's workers: that gateway exports
    their series, so that each worker is one series however many gateways Prometheus scrapes."""
    return ClusterMetrics(model_name, export_workers=not config.attach)


def route_operator_endpoints(api: Any, metrics: ClusterMetrics, service: Service, separate: bool,
                             scaling: Callable[[], Awaitable[dict[str, Any]]] | None = None) -> Any:
    """Put /metrics and /v1/workers where operators reach them. `separate` (an operator port): on an
    app of their own, returned, beside /health and /ready (which says why it is not ready), and the
    API app `api` keeps its /ready's reasons to itself (they name hosts, devices and exceptions).
    Else on `api` itself, as vLLM serves /metrics; returns None."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from cluster.serving.http.gateway import gateway_of

    if not separate:
        add_status_route(api, service, scaling)
        add_metrics_route(api, metrics, service)
        return None
    gateway = gateway_of(api)
    gateway.ready_reasons = False
    operator = FastAPI(title="pdserve operator port", docs_url=None, redoc_url=None, openapi_url=None)

    @operator.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @operator.get("/ready")
    async def ready() -> JSONResponse:
        return gateway.readiness(reasons=True)

    add_status_route(operator, service, scaling)
    add_metrics_route(operator, metrics, service)
    return operator


def add_metrics_route(app: Any, metrics: ClusterMetrics, service: Service) -> None:
    """GET /metrics: Prometheus text format, the whole cluster in one scrape (no API key); the
    workers are asked at most once per `FAN_OUT_S` (`ClusterMetrics.scrape`)."""
    from fastapi import Response

    @app.get("/metrics", include_in_schema=False)
    async def scrape() -> Response:
        return Response(await metrics.scrape(service.workers), media_type=CONTENT_TYPE)


def add_status_route(app: Any, service: Service,
                     scaling: Callable[[], Awaitable[dict[str, Any]]] | None = None) -> None:
    """GET /v1/workers: every worker's load and KV usage, and the live controller's pools and last
    decision when it runs (what `pdserve status` shows). Asked of the workers at most once per
    `FAN_OUT_S`, as /metrics."""
    loads = Throttled(service.workers, FAN_OUT_S)
    plans = Throttled(scaling, FAN_OUT_S) if scaling is not None else None

    @app.get("/v1/workers")
    async def workers() -> dict[str, Any]:
        return {"model": service.model_name, "ready": service.ready, "problem": service.problem,
                "scaling": await plans() if plans is not None else {},
                "workers": [_worker_status(load) for load in await loads()]}


def _worker_status(w: WorkerLoad) -> dict[str, Any]:
    return {"worker_id": w.worker_id, "role": w.role, "running": w.num_running, "waiting": w.num_waiting,
            "free_blocks": w.num_free_blocks, "blocks": w.num_blocks, "kv_cache_usage": w.kv_cache_usage,
            "kv_transfers": w.kv_transfers, "kv_transfer_failures": w.kv_transfer_failures,
            "kv_recomputes": w.kv_recomputes, "device": w.device, "dtype": w.dtype,
            "kv_cache_dtype": w.kv_cache_dtype, "threads": w.threads, "failure": w.failure,
            "started_at": w.started_at}
