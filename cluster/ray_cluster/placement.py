"""GPUs for the pools: how many each worker asks Ray for, what share of a GPU's memory it may take, and
the refusal of pools Ray could never place (Ray would leave their actors pending, forever).

One worker per GPU unless a pool asks otherwise: each worker holds its own copy of the weights, so
two on one GPU hold two. A pool's `num_gpus` below 1 shares GPUs: Ray then puts on one GPU any
workers whose fractions add up to 1 at most, and so each such worker may take only its fraction of
the GPU's memory (`gpu_memory_utilization` times the fraction, unless its pool sets its own, which
must stay within the fraction). Pure functions of the config and Ray's numbers: no Ray here.
"""

from __future__ import annotations

EPSILON = 1e-9  # Ray's resource amounts are decimals of 4 places at most


def gpus_per_worker(device: str, asked: float | None, ray_gpus: float, cuda_usable: bool) -> float:
    """The Ray GPUs each worker of a pool asks for: `asked` (the pool's `num_gpus`) where set; else a
    whole GPU where the engine runs on CUDA (`cuda`, `cuda:N`, or `auto` where Ray has GPUs that torch
    can use), else none."""
    if asked is not None:
        return asked
    if device == "cpu" or (device == "auto" and not (ray_gpus and cuda_usable)):
        return 0.0
    return 1.0


def worker_gpu_memory_utilization(utilization: float, pool_utilization: float | None, num_gpus: float,
                                  pool: str = "") -> float:
    """The `gpu_memory_utilization` of a worker on `num_gpus` GPUs: the engine's (`utilization`, a whole
    GPU's) or its pool's own (`pool_utilization`). A worker on a fraction of a GPU takes that fraction
    of the engine's; a pool's own past the fraction is refused: Ray may fill the rest of that GPU with
    other workers, and the utilizations on it would add up past 1."""
    if not 0 < num_gpus < 1:
        return utilization if pool_utilization is None else pool_utilization
    if pool_utilization is None:
        return round(utilization * num_gpus, 6)
    if pool_utilization > num_gpus + EPSILON:
        raise ValueError(f"{pool}: gpu_memory_utilization {pool_utilization:g} with num_gpus {num_gpus:g}: a worker "
                         f"on {num_gpus:g} of a GPU may take at most that share of its memory (Ray may put other "
                         f"workers on the rest); set the pool's gpu_memory_utilization to at most {num_gpus:g}, "
                         "or give its workers whole GPUs")
    return pool_utilization


def check_gpu_fit(workers: list[float], node_gpus: list[float]) -> None:
    """Refuse workers (each one's `num_gpus`) that Ray's nodes (each one's GPUs) cannot all hold at
    once. A fraction must fit within one GPU, a whole number of GPUs within one node; placed largest
    first, each where it first fits, as Ray packs them."""
    gpus = [[1.0] * int(count + EPSILON) for count in node_gpus]  # the free share of every GPU, per node
    for need in sorted((w for w in workers if w > 0), reverse=True):
        if not _place(need, gpus):
            raise ValueError(
                f"the workers ask Ray for GPUs {_describe(workers)} and Ray's nodes have {_describe(node_gpus)} "
                "GPU(s): they could never all start. Use fewer workers, --device cpu, or share GPUs (a pool's "
                "num_gpus below 1, e.g. 0.5 for two workers on one GPU)")


def _place(need: float, gpus: list[list[float]]) -> bool:
    for node in gpus:
        if need >= 1:
            whole = [index for index, free in enumerate(node) if free >= 1 - EPSILON][:int(need + EPSILON)]
            if len(whole) == int(need + EPSILON):
                for index in whole:
                    node[index] = 0.0
                return True
            continue
        for index, free in enumerate(node):
            if free >= need - EPSILON:
                node[index] = free - need
                return True
    return False


def _describe(amounts: list[float]) -> str:
    return "[" + ", ".join(f"{amount:g}" for amount in amounts) + "]"
