"""A planned topology as what deploys it: a `cluster.yaml` for `pdserve serve --config`, and the
equivalent `helm install --set` flags for the chart (docs/deploy.md maps values to cluster.yaml).

The Helm flags are printed rather than written as a values file: `ray.decodeGroups` is a list, and
a values file that set one group's `replicas` would replace the whole list, resources and all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cluster.planner.simulator import COLOCATED, PoolLimits, Topology
from cluster.ray_cluster.config import ClusterConfig, cluster_config_from


def cluster_values(topology: Topology, model: str = "default", dtype: str = "auto") -> dict[str, Any]:
    """The cluster.yaml mapping. Limits both pools share go in `engine:`; a plan whose pools differ
    (`--per-pool`) gives each pool its own `engine:` over it (`ClusterConfig.engine_for`)."""
    shared = topology.mode == COLOCATED or topology.prefill_limits == topology.decode_limits
    values: dict[str, Any] = {
        "mode": topology.mode,
        "decode": {"replicas": topology.num_decode},
        "engine": {"model": model, "dtype": dtype} | (_limits(topology.decode_limits) if shared else {}),
        "kv_overlap": topology.kv_overlap,
    }
    if topology.mode != COLOCATED:
        values["prefill"] = {"replicas": topology.num_prefill}
    if not shared:
        values["prefill"]["engine"] = _limits(topology.prefill_limits)
        values["decode"]["engine"] = _limits(topology.decode_limits)
    return values


def _limits(limits: PoolLimits) -> dict[str, int]:
    return {"max_num_batched_tokens": limits.max_num_batched_tokens, "max_num_seqs": limits.max_num_seqs}


def to_cluster_config(topology: Topology, model: str = "default", dtype: str = "auto") -> ClusterConfig:
    return cluster_config_from(cluster_values(topology, model, dtype))


def write_cluster_file(path: str | Path, topology: Topology, model: str = "default", dtype: str = "auto",
                       comment: str = "") -> Path:
    values = cluster_values(topology, model, dtype)
    cluster_config_from(values)  # what `pdserve serve --config` would refuse is refused here first
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    path = Path(path)
    path.write_text(header + yaml.safe_dump(values, sort_keys=False), encoding="utf-8")
    return path


def helm_flags(topology: Topology) -> list[str]:
    """`--set` flags for helm/pdserve, one worker per pod: a group's replicas (and its autoscaling
    bounds, which default to 1) make its pool's size; limits per pool go to `cluster.<pool>.engine`."""
    groups = [("ray.decodeGroups[0]", topology.num_decode)]
    if topology.mode != COLOCATED:
        groups.insert(0, ("ray.prefill", topology.num_prefill))
    flags = [f"cluster.mode={topology.mode}"]
    for group, replicas in groups:
        flags += [f"{group}.{key}={replicas}" for key in ("replicas", "minReplicas", "maxReplicas")]
    pools = [("engine", topology.decode_limits)]
    if topology.mode != COLOCATED and topology.prefill_limits != topology.decode_limits:
        pools = [("prefill.engine", topology.prefill_limits), ("decode.engine", topology.decode_limits)]
    flags += [f"cluster.{section}.{key}={value}" for section, limits in pools for key, value in _limits(limits).items()]
    return [item for flag in flags for item in ("--set", flag)]
