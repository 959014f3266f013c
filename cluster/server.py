"""The serving process: the cluster (or one local engine) behind both front doors, until a signal.

    pdserve serve [--config cluster.yaml] [--host 0.0.0.0] [--port 8000] [--grpc-port 50051] [--api-key K]

Order matters for operators: the HTTP and gRPC servers listen first, answering /health (alive) and
503 on /ready and on requests while the workers load the model (a minute on a cold cache); then
the cluster starts and the service turns ready. On SIGINT/SIGTERM uvicorn stops accepting and lets
open requests finish (`--drain-s`), the gRPC server does the same, then the cluster stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cluster.cluster import Cluster
from cluster.cluster_config import ClusterConfig
from cluster.metrics import CONTENT_TYPE, ClusterMetrics, MeteredService
from cluster.rate_limits import RateLimits
from cluster.sampling_params import SamplingParams
from cluster.service import ClusterService, LocalService, Service, ServiceUnavailable
from cluster.shared_state import SharedState, connect_state
from cluster.tokenizer import Tokenizer
from cluster.worker import TokenEvent, WorkerLoad

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    grpc_port: int = 50051  # 0 picks a free port; -1 turns gRPC off
    api_key: str | None = None  # None: $PDSERVE_API_KEY, if set
    drain_s: float = 30.0
    redis_url: str = ""  # the rate limits' buckets (shared by gateway replicas); empty: this process's
    rate_limit_rps: float = 0.0  # requests per second per API key; 0: none
    rate_limit_tpm: float = 0.0  # prompt + max tokens per minute per API key; 0: none


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


class Backend:
    """What runs behind the front doors: the Ray cluster, or with `local` one engine in this process."""

    def __init__(self, config: ClusterConfig, local: bool = False) -> None:
        self.config, self.local = config, local
        self.cluster: Cluster | None = None
        self.local_service: LocalService | None = None

    def describe(self) -> str:
        if self.local:
            return "one local engine (no Ray)"
        where = f"Ray at {self.config.ray_address}" if self.config.ray_address else "an embedded local Ray"
        return (f"a {self.config.mode} cluster ({self.config.prefill.replicas} prefill, "
                f"{self.config.decode.replicas} decode) on {where}")

    async def start(self) -> Service:
        """Load the model everywhere (in a thread: Ray and the weights block) and return the service."""
        if self.local:
            self.local_service = await asyncio.to_thread(LocalService.from_config, self.config.engine)
            return await self.local_service.start()
        self.cluster = await asyncio.to_thread(Cluster(self.config).start)
        return ClusterService(self.cluster)

    async def counters(self) -> dict[str, Any]:
        """The router's decisions, for /metrics (none for a local engine)."""
        if self.cluster is None or self.cluster.router is None:
            return {}
        return await self.cluster.router_stats()

    async def stop(self) -> None:
        """Stop whatever started; safe to call twice."""
        if self.local_service is not None:
            await self.local_service.stop()
            self.local_service = None
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.stop)
            self.cluster = None
            if not self.config.ray_address:  # the embedded Ray is ours: stop its processes too
                import ray

                await asyncio.to_thread(ray.shutdown)


async def serve(service: DeferredService, backend: Backend, options: ServeOptions,
                on_listening: Callable[[str, int | None], None] | None = None) -> None:
    """Listen, start the backend, serve until the HTTP server stops (a signal), then stop it all."""
    from cluster.grpc_server import GrpcServer
    from cluster.http_gateway import HttpServer, build_app

    metrics = ClusterMetrics(service.model_name)
    state = connect_state(options.redis_url)
    metrics.sources.append(backend.counters)
    metrics.sources.append(lambda: _state_counters(state))
    metered = MeteredService(service, metrics.requests)  # both front doors: every request is timed
    limits = RateLimits(state, options.rate_limit_rps, options.rate_limit_tpm)
    app = build_app(metered, api_key=options.api_key, limits=limits)
    add_status_route(app, metered)
    add_metrics_route(app, metrics, metered)
    http = HttpServer(app, options.host, options.port, graceful_shutdown_s=options.drain_s)
    await http.start()
    grpc = None
    try:
        if options.grpc_port >= 0:
            grpc = GrpcServer(metered, options.host, options.grpc_port, api_key=options.api_key)
            await grpc.start()
        if on_listening is not None:
            on_listening(http.url, grpc.port if grpc is not None else None)
        service.attach(await backend.start())
        log.info("ready: serving %s", service.model_name)
        await http.wait()
    finally:
        await http.stop()
        if grpc is not None:
            await grpc.stop(options.drain_s)
        await backend.stop()
        await state.close()


async def _state_counters(state: SharedState) -> dict[str, Any]:
    """Calls to Redis answered by a fallback (rate limits failed open) in this gateway."""
    fallbacks = getattr(state, "fallbacks", None)
    return {"counters": {"pdserve:gateway_redis_fallbacks": sum(fallbacks.values())}} if fallbacks is not None else {}


def add_metrics_route(app: Any, metrics: ClusterMetrics, service: Service) -> None:
    """GET /metrics: Prometheus text format, the whole cluster in one scrape (no API key)."""
    from fastapi import Response

    @app.get("/metrics", include_in_schema=False)
    async def scrape() -> Response:
        return Response(await metrics.exposition(service), media_type=CONTENT_TYPE)


def add_status_route(app: Any, service: Service) -> None:
    """GET /v1/workers: every worker's load and KV usage (what `pdserve status` shows)."""

    @app.get("/v1/workers")
    async def workers() -> dict[str, Any]:
        loads = await service.workers()
        return {"model": service.model_name, "ready": service.ready,
                "workers": [{"worker_id": w.worker_id, "role": w.role, "running": w.num_running,
                             "waiting": w.num_waiting, "free_blocks": w.num_free_blocks, "blocks": w.num_blocks,
                             "kv_cache_usage": w.kv_cache_usage} for w in loads]}
