"""Starting and stopping the cluster on Ray: an embedded local Ray by default, or an existing one.

`Cluster.start()` creates the pools of `WorkerActor`s (fractional CPUs so several fit on a small
machine; custom resources pin each pool to its nodes) and the `Router`, and waits until every
worker has loaded its model. `generate()` streams a request's `TokenEvent`s through the router.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from typing import Any

from cluster.actors import Router, RouterConfig, TokenEvent, WorkerActor
from cluster.cluster_config import ClusterConfig, PoolConfig
from cluster.default_model import resolve_model_path
from cluster.sampling_params import SamplingParams
from cluster.tokenizer import Tokenizer
from cluster.worker import WorkerLoad

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


class Cluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.prefill: list[Any] = []
        self.decode: list[Any] = []
        self.router: Any = None
        self.ids = itertools.count()
        self.uid = uuid.uuid4().hex[:8]  # several clusters may share one Ray (benchmarks, tests)
        self.model_name = ""
        self.max_model_len = 0
        self.tokenizer: Tokenizer | None = None

    def start(self) -> Cluster:
        import ray

        init_ray(self.config.ray_address)
        colocated = self.config.mode == "colocated"
        if not colocated:
            self.prefill = self._pool("prefill", self.config.prefill)
        self.decode = self._pool("colocated" if colocated else "decode", self.config.decode)
        ray.get([worker.start.remote() for worker in self.prefill + self.decode], timeout=START_TIMEOUT_S)
        infos = ray.get([worker.info.remote() for worker in self.prefill + self.decode])
        self.model_name = infos[0][0]
        self.max_model_len = min(max_model_len for _, max_model_len in infos)  # every worker must fit it
        self.tokenizer = Tokenizer.from_dir(resolve_model_path(self.config.engine.model.model))
        router_class = ray.remote(num_cpus=0)(Router)
        router_config = RouterConfig(self.config.mode, self.config.kv_lease_s, self.config.engine.cache.block_size,
                                     self.model_name, self.config.redis_url, self.config.routing)
        self.router = router_class.remote(self._named("prefill", self.prefill),
                                          self._named("colocated" if colocated else "decode", self.decode),
                                          router_config)
        return self

    @staticmethod
    def _named(role: str, handles: list[Any]) -> list[tuple[str, Any]]:
        """(worker id, handle) pairs: the ids the workers were given (`_pool`)."""
        return [(f"{role}-{index}", handle) for index, handle in enumerate(handles)]

    def _pool(self, role: str, pool: PoolConfig) -> list[Any]:
        import ray

        actor_class = ray.remote(WorkerActor)
        return [actor_class.options(num_cpus=pool.num_cpus, resources=dict(pool.resources),
                                    name=f"pdserve-{self.uid}-{role}-{index}").remote(
                                        f"{role}-{index}", role, self.config.engine,
                                        overlap_transfer=self.config.kv_overlap, redis_url=self.config.redis_url)
                for index in range(pool.replicas)]

    async def generate(self, prompt: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        request_id = request_id or f"cluster-{next(self.ids)}"
        async for ref in self.router.generate.options(num_returns="streaming").remote(request_id, prompt, params):
            yield await ref

    async def abort(self, request_id: str) -> None:
        """End a request on every worker (its blocks freed everywhere)."""
        await self.router.abort.remote(request_id)

    async def workers(self) -> list[WorkerLoad]:
        """Each live worker's load; a dead one is left out."""
        loads = []
        for worker in self.prefill + self.decode:
            with contextlib.suppress(Exception):
                loads.append(await worker.load.remote())
        return loads

    def stop(self) -> None:
        import ray

        for worker in self.prefill + self.decode:
            with contextlib.suppress(Exception):  # a dead worker needs no stopping
                ray.get(worker.stop.remote(), timeout=30)
            ray.kill(worker)
        if self.router is not None:
            ray.kill(self.router)
        self.prefill, self.decode, self.router = [], [], None
