"""Cluster configuration: pools, placement and transport, from a YAML file with CLI overrides.

```yaml
mode: disaggregated        # or colocated: every worker runs both phases (the baseline)
prefill: {replicas: 1, num_cpus: 0.25, resources: {}, threads: 0}  # threads 0: every core no busy worker holds
decode:  {replicas: 1, num_cpus: 0.25, resources: {}, threads: 0,
          engine: {max_num_seqs: 64}}  # the pool's own engine limits, over `engine:` below (POOL_ENGINE_KEYS)
# A pool's `engine: {tensor_parallel_size: N}` splits each of its workers' model across N ranks: N
# processes on the worker's node, num_cpus and num_gpus asked of Ray for each (docs/ray_cluster.md).
transport: ucx             # how KV blocks travel between prefill and decode workers
kv_shared_memory: true     # workers on one host pass KV through shared memory (false: UCX's transports always)
kv_overlap: true           # send KV blocks while the rest of the prompt computes
kv_lease_s: 30             # a decode worker's reservation waits this long for its KV
redis_url: ""              # redis://host:6379/0: workers publish their cached blocks for KV-aware routing
routing: kv-aware          # prefill workers by queue and cached prefix; or load, or round-robin
routers: 1                 # router replicas (Ray actors); with redis_url they share the prefix index
worker_max_restarts: 3     # Ray restarts a dead worker this often (-1: always); it rejoins routing
worker_wait_s: 60          # with no live worker of a role, a request waits this long for one to restart
max_prefill_wait_s: 10     # refuse new prompts (429) past this many seconds of prompts queued per prefill worker
max_decode_wait_s: 10      # and new requests that every decode worker would keep waiting this long for a slot
decode_prefix_reuse: true  # a decode worker keeps the blocks it holds of a prompt: only the rest is prefilled and sent
local_prefill_threshold: 0 # a decode worker computes an uncached rest shorter than this itself (0: never)
prefix_fetch: false        # a prefill worker takes a prompt's prefix cached on a peer worker over the KV transfer
tracing: {endpoint: "", sample_ratio: 1.0}  # OTLP/gRPC collector for traces (docs/observability.md, Traces); "": off
scaling:                   # the live controller (docs/deploy.md, Scaling live); off unless enabled
  enabled: false
  prefill: {min_workers: 1, max_workers: 4}
  decode: {min_workers: 1, max_workers: 4}
  ttft_s: 2.0              # targets: a prefill pool whose queue + prefill p90 passes this grows
  itl_s: 0.2               # a decode pool whose seconds per generated token pass this grows
  queue_depth: 4           # a pool whose workers have more waiting requests each than this grows
  scale_down_below: 0.3    # a pool under this fraction of every target, nothing waiting, shrinks
  sustain_s: 10            # a signal must hold this long before growing
  scale_down_sustain_s: null  # every signal must stay low this long before shrinking (null: sustain_s)
  cooldown_s: 60           # no other decision on a pool this long after one
  warm_spares: 0           # workers per pool started and warmed up but not routed to: growing enables one at once
  interval_s: 1            # how often the controller looks
  drain_timeout_s: 120     # a draining worker's requests still there then are handed off (resumed)
attach: false              # start no workers: route to those listed in redis_url's registry
name: ""                   # with ray_address: workers outlive the gateway; one started again takes them over
reserved_cpus: 0           # cores of each host kept for the front door (gateway, router, Ray); engines use the rest
engine:
  model: default
  dtype: auto               # bf16 where the worker's CPU (AMX, AVX512-BF16) or GPU has it natively, else fp32
  kv_cache_memory_gb: null    # set: each worker's KV cache in GB, on any device; null: 1 GB on CPUs, and on GPUs
  gpu_memory_utilization: 0.9 # what gpu_memory_utilization of its GPU leaves after weights and activations
  kv_cache_dtype: auto      # fp8 (e4m3), fp8_e5m2: a byte per key and value (a pool may set its own)
  host_kv_cache_gb: null    # set: a host KV tier of this many GB per worker: evicted prefix blocks stay in
  num_host_kv_blocks: 0     # host memory and come back on a hit (or its size in blocks; a pool may set its own)
  host_kv_disk_dir: ""      # set: the host KV tier in a memory-mapped file in this directory (local disk)
  max_num_batched_tokens: 2048
  max_num_seqs: 256
  deterministic: false      # every token independent of its batch, chunking and resumes (slower; CPUs)
  quantization: none        # gguf: a .gguf model's Q8_0/Q4_*/Q5_*/Q6_K weights stay packed; int8/fp8
                            # safetensors (compressed-tensors, fp8) stay 8-bit as config.json declares
  tensor_parallel_size: 1   # ranks per worker (a pool may set its own: KV moves between sizes whole)
  speculative_config: null  # vLLM's: {method: ngram, num_speculative_tokens: 4, prompt_lookup_min: 2,
                            # prompt_lookup_max: 4} or {model: DRAFT_PATH, num_speculative_tokens: 4}; a pool
                            # may set its own (the decode pool's is what counts)
```

`resources` are Ray custom resources (e.g. `{prefill_node: 1}`) that pin a pool to the nodes meant
for it. Every value is checked at start with an error that names the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from cluster.common.roles import Mode, RoutingPolicy
from cluster.engine.config import CacheConfig, EngineConfig, SpeculativeConfig
from cluster.observability.tracing import TracingConfig

TRANSPORTS = ("ucx",)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    replicas: int = 1
    num_cpus: float = 0.25  # fractional: on a 2-core machine several workers must fit
    resources: dict[str, float] = field(default_factory=dict)
    # Ray GPUs per worker. None: 0 on the CPU; 0.5 where the engine's device is CUDA (so one prefill
    # and one decode worker share a GPU), or where it is auto and the Ray cluster has GPUs.
    num_gpus: float | None = None
    # The network interface whose address the pool's KV listeners advertise (e.g. an RDMA NIC);
    # empty: each node's own address as Ray knows it.
    kv_interface: str = ""
    # Calls a worker runs at once, its streams included (Ray's max_concurrency of an async actor);
    # aborts and load polls run apart from them (the "control" group), so they never queue behind.
    max_concurrency: int = 1000
    # torch threads of each worker. 0: they follow the load, every core of its host that no other busy
    # worker holds, at least its num_cpus (`cluster.worker.node_cores`); N: N threads, fixed (a host
    # shared with other programs, whose load the workers cannot see).
    threads: int = 0
    # The pool's own engine limits, flat keys as in `engine:` and merged over it (POOL_ENGINE_KEYS):
    # e.g. a decode pool's max_num_seqs and KV cache apart from the prefill pool's token budget.
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: follow the load), got {self.threads}")
        if self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
        if self.num_cpus < 0:
            raise ValueError(f"num_cpus must be >= 0, got {self.num_cpus}")
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ValueError(f"num_gpus must be >= 0 (or unset), got {self.num_gpus}")


@dataclass(frozen=True, slots=True)
class PoolBounds:
    """How small and how large the live controller may make one pool."""

    min_workers: int = 1
    max_workers: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"scaling bounds need 1 <= min_workers <= max_workers, got {self.min_workers} and "
                             f"{self.max_workers}")


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    """The live controller (`cluster.ray_cluster.scaler`): its bounds, targets and hysteresis. A target
    of 0 is not watched."""

    enabled: bool = False
    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    ttft_s: float = 2.0
    itl_s: float = 0.2
    queue_depth: float = 4.0
    scale_down_below: float = 0.3
    sustain_s: float = 10.0
    # Shrinking waits longer than growing where this is longer (Ray Serve's downscale_delay_s against
    # its upscale_delay_s): a short sustain_s grows a pool early in a step, a long one here keeps a
    # lull inside it from giving the worker back. None: sustain_s.
    scale_down_sustain_s: float | None = None
    cooldown_s: float = 60.0
    interval_s: float = 1.0
    drain_timeout_s: float = 120.0
    # Workers per pool started (model loaded, warmed up) but not routed to, within max_workers with
    # those serving: growing routes to one at once instead of waiting for a model to load.
    warm_spares: int = 0

    def __post_init__(self) -> None:
        for key in ("ttft_s", "itl_s", "queue_depth", "sustain_s", "cooldown_s", "drain_timeout_s", "warm_spares"):
            if getattr(self, key) < 0:
                raise ValueError(f"scaling.{key} must be >= 0, got {getattr(self, key)}")
        if self.scale_down_sustain_s is not None and self.scale_down_sustain_s < 0:
            raise ValueError(f"scaling.scale_down_sustain_s must be >= 0 (or null: sustain_s), got "
                             f"{self.scale_down_sustain_s}")
        if self.interval_s <= 0:
            raise ValueError(f"scaling.interval_s must be > 0, got {self.interval_s}")
        if not 0 <= self.scale_down_below < 1:
            raise ValueError(f"scaling.scale_down_below must be in [0, 1), got {self.scale_down_below}")

    def bounds(self, role: str) -> PoolBounds:
        """The bounds of the pool of `role` (a colocated pool takes the decode pool's)."""
        return self.prefill if role == "prefill" else self.decode

    @property
    def down_sustain_s(self) -> float:
        """How long a pool stays under its targets before it shrinks."""
        return self.sustain_s if self.scale_down_sustain_s is None else self.scale_down_sustain_s


def scaling_config_from(values: dict[str, Any]) -> ScalingConfig:
    """The YAML `scaling:` section, its pools' bounds as nested mappings."""
    pools: dict[str, PoolBounds] = {pool: PoolBounds(**values[pool]) for pool in ("prefill", "decode")
                                    if pool in values}
    return ScalingConfig(**{**values, **pools})


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    mode: str = Mode.DISAGGREGATED
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    transport: str = "ucx"
    # UCX_TLS for every worker (e.g. "tcp", "rc,sm,self", "tcp,cuda_copy,cuda_ipc"); empty: the workers'
    # environment, else UCX's default. docs/deploy.md says which to pick.
    ucx_transports: str = ""
    kv_shared_memory: bool = True  # same-host KV through /dev/shm (docs/performance.md); false: UCX/TCP always
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(cache=CacheConfig(cpu_kv_cache_memory_gb=1.0)))
    ray_address: str = ""  # empty: start an embedded local Ray
    kv_lease_s: float = 30.0
    kv_overlap: bool = True  # send a prompt's KV chunk by chunk as it computes (else once, at its end)
    redis_url: str = ""  # state shared by router replicas and workers (prefix index); empty: the router's own
    routing: str = RoutingPolicy.KV_AWARE  # how prefill workers are picked: "kv-aware", "load" or "round-robin"
    routers: int = 1  # router replicas; requests are spread over them, each sees every worker
    worker_max_restarts: int = 3  # Ray restarts a dead worker (its requests resume elsewhere meanwhile)
    # With no live worker of a role (the only decode worker died), a request, new or resumed, waits
    # this long for one to come back (Ray restarts it: the model loads again) before it fails (503).
    worker_wait_s: float = 60.0
    # Admission: a new prompt is refused (429, Retry-After) when every prefill worker has more than
    # this many seconds of prompts queued (by its measured throughput), instead of waiting until its
    # KV lease ends and the decode worker recomputes it. Below kv_lease_s; 0: no limit.
    max_prefill_wait_s: float = 10.0
    # Admission on the decode side: a new request is refused (429) when every decode worker has more
    # than this many seconds of requests queued for its running slots (by its measured request time).
    max_decode_wait_s: float = 10.0
    # Decode-side prefix reuse: a request goes to the decode worker holding the longest beginning of its
    # prompt (a conversation's earlier turns), which keeps those blocks; only the rest is prefilled and
    # sent. false: every prompt's KV travels whole.
    decode_prefix_reuse: bool = True
    # Conditional disaggregation: a prompt whose part the decode worker does not hold is shorter than
    # this many tokens is computed on the decode worker, no prefill worker asked. 0: never (the default:
    # a local prefill shares the decode worker's steps with its running batch; docs/performance.md).
    local_prefill_threshold: int = 0
    # A prefill worker fetches the beginning of a prompt that another worker (prefill or decode) caches
    # over the KV transfer instead of computing it (`cluster.engine.prefix_pins`); every worker then
    # both sends and receives KV. false: a prefill worker computes what its own cache lacks.
    prefix_fetch: bool = False
    attach: bool = False  # start no workers; use those listed in the registry at redis_url (a second gateway)
    # The cluster's name. With it the workers are detached Ray actors named after it: they outlive the
    # gateway, and a gateway started again with the same name (and engine config) takes them over
    # without loading the model again. Needs ray_address: an embedded Ray ends with its gateway.
    name: str = ""
    # OpenTelemetry traces (docs/observability.md, Traces): every process exports its spans to `endpoint` over OTLP;
    # off (and free) without one.
    tracing: TracingConfig = field(default_factory=TracingConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)  # the live controller; off by default
    # Cores of each host kept for the front door: the gateway and every process it starts run on the
    # first K, each worker's engine threads on the others (`cluster.worker.cpu_binding`); 0: no binding.
    reserved_cpus: int = 0

    def __post_init__(self) -> None:
        for key, choices in (("mode", tuple(map(str, Mode))), ("transport", TRANSPORTS),
                             ("routing", tuple(map(str, RoutingPolicy))), ("kv_shared_memory", (True, False)),
                             ("decode_prefix_reuse", (True, False)), ("prefix_fetch", (True, False))):
            if getattr(self, key) not in choices:
                raise ValueError(f"{key} must be one of {choices}, got {getattr(self, key)!r}")
        if self.routers < 1:
            raise ValueError(f"routers must be >= 1, got {self.routers}")
        if self.reserved_cpus < 0:
            raise ValueError(f"reserved_cpus must be >= 0 (0: none kept for the front door), got {self.reserved_cpus}")
        if self.worker_max_restarts < -1:
            raise ValueError(f"worker_max_restarts must be >= -1 (-1: always), got {self.worker_max_restarts}")
        if not 0 <= self.max_prefill_wait_s < self.kv_lease_s:
            raise ValueError(f"max_prefill_wait_s must be >= 0 and below kv_lease_s ({self.kv_lease_s:g}): a prompt "
                             f"admitted must be computed before its lease ends, got {self.max_prefill_wait_s}")
        for key in ("max_decode_wait_s", "worker_wait_s", "local_prefill_threshold"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.name:
            self._check_name()
        if self.attach and not self.redis_url:
            raise ValueError("attach needs redis_url: the workers to attach to are listed in its registry")
        self._check_pools()
        self._check_scaling()

    def engine_for(self, role: str) -> EngineConfig:
        """The engine config of the workers of the pool of `role`: `engine:` with the pool's own
        overrides (a colocated pool is the decode pool)."""
        pool = self.prefill if role == "prefill" else self.decode
        return engine_config_from(pool.engine, base=self.engine) if pool.engine else self.engine

    def _check_pools(self) -> None:
        if self.decode.replicas < 1:
            raise ValueError("decode.replicas must be >= 1: decode workers serve every request")
        if self.mode == Mode.DISAGGREGATED and self.prefill.replicas < 1:
            raise ValueError("prefill.replicas must be >= 1 in disaggregated mode (or use mode: colocated)")
        for name in ("prefill", "decode"):
            self._check_pool_engine(name)

    def _check_pool_engine(self, name: str) -> None:
        overrides = getattr(self, name).engine
        if not isinstance(overrides, dict):
            raise ValueError(f"{name}.engine must be a mapping of engine keys, got {overrides!r}")
        for key in overrides:
            if key not in ENGINE_KEYS and key != "attention_backend":
                raise ValueError(f"{name}.engine.{key}: unknown engine key; per pool: {', '.join(POOL_ENGINE_KEYS)}")
            if key not in POOL_ENGINE_KEYS:
                raise ValueError(f"{name}.engine.{key} cannot differ between pools: both run one model and pass KV "
                                 f"blocks in one layout; set it in engine: (per pool: {', '.join(POOL_ENGINE_KEYS)})")
        try:
            self.engine_for(name)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{name}.engine: {error}") from error

    def _check_scaling(self) -> None:
        if not self.scaling.enabled:
            return
        if self.attach:
            raise ValueError("scaling and attach exclude each other: an attached gateway starts no workers")
        if self.scaling.warm_spares and self.redis_url:
            raise ValueError("scaling.warm_spares needs redis_url empty: a spare lists itself in the shared registry, "
                             "where routers would find it and route to it")
        pools = [("decode", self.decode)] + ([("prefill", self.prefill)] if self.mode == Mode.DISAGGREGATED else [])
        for name, pool in pools:
            bounds = self.scaling.bounds(name)
            if not bounds.min_workers <= pool.replicas <= bounds.max_workers:
                raise ValueError(f"{name}.replicas ({pool.replicas}) must lie within scaling.{name}'s min_workers "
                                 f"({bounds.min_workers}) and max_workers ({bounds.max_workers})")

    def _check_name(self) -> None:
        if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", self.name):  # a DNS label, as a Helm release
            raise ValueError(f"name must be lowercase letters, digits and '-' (63 at most), got {self.name!r}")
        if not self.ray_address:
            raise ValueError("name (workers that outlive the gateway) needs ray_address: an embedded Ray ends with "
                             "the gateway that started it")
        if self.attach:
            raise ValueError("name and attach exclude each other: an attached gateway starts no workers")


ENGINE_KEYS = {
    "model": ("model", "model"), "dtype": ("model", "dtype"), "device": ("model", "device"),
    "max_model_len": ("model", "max_model_len"), "deterministic": ("model", "deterministic"),
    "quantization": ("model", "quantization"), "tensor_parallel_size": ("model", "tensor_parallel_size"),
    "block_size": ("cache", "block_size"), "num_blocks": ("cache", "num_blocks"),
    "kv_cache_memory_gb": ("cache", "kv_cache_memory_gb"), "enable_prefix_caching": ("cache", "enable_prefix_caching"),
    "kv_cache_dtype": ("cache", "kv_cache_dtype"), "gpu_memory_utilization": ("cache", "gpu_memory_utilization"),
    "host_kv_cache_gb": ("cache", "host_kv_cache_gb"), "num_host_kv_blocks": ("cache", "num_host_kv_blocks"),
    "host_kv_disk_dir": ("cache", "host_kv_disk_dir"),
    "max_num_batched_tokens": ("scheduler", "max_num_batched_tokens"), "max_num_seqs": ("scheduler", "max_num_seqs"),
    "preemption_mode": ("scheduler", "preemption_mode"),
    # vLLM's mapping as it is ({method: ngram, num_speculative_tokens: 4, ...}): the whole section.
    "speculative_config": ("speculative", ""),
}


# What a pool may set apart in its own `engine:` (the rest is one for the cluster: the model, its
# dtype and device, and the KV layout that transfers between the pools rely on). Tensor parallelism
# is a pool's own: an engine exports and imports every KV head, whatever its ranks.
POOL_ENGINE_KEYS = ("kv_cache_memory_gb", "gpu_memory_utilization", "kv_cache_dtype", "num_blocks",
                    "enable_prefix_caching", "host_kv_cache_gb", "num_host_kv_blocks", "host_kv_disk_dir",
                    "max_num_batched_tokens",
                    "max_num_seqs", "preemption_mode",
                    "attention_backend", "tensor_parallel_size", "speculative_config")


def engine_config_from(values: dict[str, Any], base: EngineConfig | None = None) -> EngineConfig:
    """Flat engine keys (as in the YAML `engine:` section) over a base config."""
    base = base or EngineConfig(cache=CacheConfig(cpu_kv_cache_memory_gb=1.0))
    parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "speculative": {}}
    for key, value in values.items():
        if key == "attention_backend":
            continue
        if key not in ENGINE_KEYS:
            raise ValueError(f"unknown engine key {key!r}; known: {', '.join(sorted(ENGINE_KEYS))}")
        section, name = ENGINE_KEYS[key]
        parts[section][name] = value
    speculative = SpeculativeConfig.from_dict(values["speculative_config"]) if "speculative_config" in values \
        else base.speculative
    return EngineConfig(model=replace(base.model, **parts["model"]) if parts["model"] else base.model,
                        cache=replace(base.cache, **parts["cache"]) if parts["cache"] else base.cache,
                        scheduler=replace(base.scheduler, **parts["scheduler"]) if parts["scheduler"]
                        else base.scheduler,
                        attention_backend=values.get("attention_backend", base.attention_backend),
                        speculative=speculative)


def load_cluster_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Read the YAML file (if any), apply overrides (same shape, e.g. {"decode": {"replicas": 2}})."""
    values: dict[str, Any] = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        values = loaded
    return cluster_config_from(merged(values, overrides or {}))


def merged(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` over `values`, mappings merged key by key at every depth (a pool's `engine:` too)."""
    result = dict(values)
    for key, value in overrides.items():
        result[key] = merged(result[key], value) if isinstance(value, dict) and isinstance(result.get(key), dict) \
            else value
    return result


def cluster_config_from(values: dict[str, Any]) -> ClusterConfig:
    known = {f.name for f in fields(ClusterConfig)}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown cluster config keys {sorted(unknown)}; known: {sorted(known)}")
    kwargs: dict[str, Any] = {k: v for k, v in values.items()
                              if k not in ("prefill", "decode", "engine", "tracing", "scaling")}
    if "tracing" in values:
        kwargs["tracing"] = TracingConfig(**values["tracing"])
    if "scaling" in values:
        kwargs["scaling"] = scaling_config_from(values["scaling"])
    for pool in ("prefill", "decode"):
        if pool in values:
            kwargs[pool] = PoolConfig(**values[pool])
    if "engine" in values:
        kwargs["engine"] = engine_config_from(values["engine"])
    return ClusterConfig(**kwargs)
