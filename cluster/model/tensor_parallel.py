"""Tensor parallelism inside one engine, Megatron-style: each rank holds a slice of every layer.

Rank r of `size` holds attention heads [r*H/size, (r+1)*H/size) of the queries and the same share of
the KV heads, the matching rows of `qkv_proj` and `gate_up_proj` (column-parallel: each rank computes
its own heads and its own part of the MLP's intermediate), and the matching columns of `o_proj` and
`down_proj` (row-parallel: each rank's product is a partial sum of the full output, summed across
ranks by one all-reduce after each). A mixture of experts splits every expert the same way (each rank
holds its share of each expert's intermediate, routes every token as the others do, and its block's
output is summed), as vLLM's tensor-parallel MoE does. Norms, the rotary tables, the routers, the
embeddings and the lm head stay replicated: every rank holds the whole residual stream, so after the
last all-reduce every rank has the same hidden states, and rank 0 alone computes logits and samples.

```
 hidden ──> qkv_proj[rows of my heads] ──> attention (my heads, my KV cache) ──> o_proj[my columns] ─┐
   ^                                                                                  all_reduce(sum)─┘
   └── gate_up_proj[my rows] ──> SiLU * up ──> down_proj[my columns] ──> all_reduce(sum) ──> next layer
```

Rank 0 (the engine's runner) sends every step to the other ranks (`cluster.model.ranks`): a small JSON
header through a pipe to each, then the step's tensors by broadcast over the group. Headers go through
pipes, not the group, so an idle rank waits on its pipe without a collective's timeout, and sees
rank 0's end (the pipe closes) the moment its process ends, even when it is killed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cluster.model.architecture import ArchitectureConfig
from cluster.model.moe import SparseMoeBlock

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)  # a step's collectives, a weight's broadcast
# Checkpoint name fragments of column-parallel parameters: each rank keeps its rows (Mixtral's experts
# name gate and up w1 and w3).
COLUMN_PARALLEL = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.", ".w1.", ".w3.")
# Row-parallel layers: each rank keeps its columns of the weight, and their outputs are summed.
ROW_PARALLEL = ("o_proj", "down_proj")
ROW_PARALLEL_EXPERTS = ".w2.weight"  # Mixtral's experts' down projection


def check_tensor_parallel(arch: ArchitectureConfig, size: int, quantization: str = "none") -> None:
    """Refuse a size this model cannot be split by, naming the sizes that would split it."""
    if size == 1:
        return
    if quantization != "none":
        raise ValueError(f"quantization {quantization!r} serves tensor_parallel_size 1 only (packed weights are "
                         f"not split across ranks), got tensor_parallel_size {size}")
    dims = {"attention heads": arch.num_heads, "KV heads": arch.num_kv_heads,
            "intermediate size": arch.intermediate_size}
    if arch.moe is not None and arch.moe.sparse_layers:
        dims["expert intermediate size"] = arch.moe.intermediate_size
    if any(value % size for value in dims.values()):
        fits = [n for n in range(1, arch.num_kv_heads + 1) if all(value % n == 0 for value in dims.values())]
        described = ", ".join(f"{value} {name}" for name, value in dims.items())
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {described}; "
                         f"sizes that do: {fits}")


def shard_architecture(arch: ArchitectureConfig, size: int) -> ArchitectureConfig:
    """The architecture one rank builds: its share of the heads and of the MLP's intermediate."""
    check_tensor_parallel(arch, size)
    moe = arch.moe and dataclasses.replace(arch.moe, intermediate_size=arch.moe.intermediate_size // size)
    return dataclasses.replace(arch, num_heads=arch.num_heads // size, num_kv_heads=arch.num_kv_heads // size,
                               intermediate_size=arch.intermediate_size // size, moe=moe)


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], arch: ArchitectureConfig, rank: int,
                  size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as rank `rank` loads them (full-model names, rank-local shapes)."""
    for name, tensor in weights:
        yield name, shard_tensor(name, tensor, arch, rank, size)


def shard_tensor(name: str, tensor: torch.Tensor, arch: ArchitectureConfig, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of one checkpoint tensor. q/k/v rows are head-major, so a rank's rows are its
    heads; gate and up rows are the intermediate's, so a rank's rows are its share of it."""
    if size == 1:
        return tensor
    if ".qkv_proj." in name:  # stored fused (Phi-3): each of q, k and v split by heads
        kv = arch.num_kv_heads * arch.head_dim
        parts = tensor.split([arch.num_heads * arch.head_dim, kv, kv])
        return torch.cat([part.chunk(size)[rank] for part in parts])
    if ".gate_up_proj." in name:  # stored fused (Phi-3): gate's rows then up's
        return torch.cat([part.chunk(size)[rank] for part in tensor.chunk(2)])
    if name.endswith(".experts.gate_up_proj"):  # experts stacked [experts, 2 * inter, hidden], gate rows first
        return torch.cat([part.chunk(size, dim=1)[rank] for part in tensor.chunk(2, dim=1)], dim=1)
    if name.endswith(".experts.down_proj"):  # stacked [experts, hidden, inter]
        return tensor.chunk(size, dim=2)[rank].contiguous()
    if name.endswith(ROW_PARALLEL_EXPERTS):
        return tensor.chunk(size, dim=1)[rank].contiguous()
    if any(fragment in name for fragment in COLUMN_PARALLEL):
        return tensor.chunk(size)[rank]
    if any(f".{layer}.weight" in name for layer in ROW_PARALLEL):
        return tensor.chunk(size, dim=1)[rank].contiguous()
    if any(f".{layer}.bias" in name for layer in ROW_PARALLEL):
        # Added once to the sum: rank 0 keeps it, the others add zeros.
        return tensor if rank == 0 else torch.zeros_like(tensor)
    return tensor


def reduce_row_parallel_outputs(model: nn.Module, group: TensorParallelGroup) -> None:
    """Sum each row-parallel layer's output (and each sparse MLP's: its experts' down projections are
    row-parallel) across ranks, in place, as the layer returns it. A forward hook keeps the model's code
    the one-device model's, for every architecture built on it."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ROW_PARALLEL or isinstance(module, SparseMoeBlock):
            module.register_forward_hook(lambda _module, _args, output: group.all_reduce(output))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the engine's own (each rank has a GPU of its own), or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


@dataclasses.dataclass
class TensorParallelGroup:
    """One engine's ranks: the gloo group that carries step inputs (and, on CPUs, the all-reduces),
    the device group for the all-reduces (NCCL on GPUs), and the pipes that carry headers (rank 0
    holds one per other rank, the others one to rank 0)."""

    rank: int
    size: int
    messages: Any  # dist.ProcessGroupGloo
    device_group: Any  # the same group on CPUs; dist.ProcessGroupNCCL on GPUs
    pipes: Sequence[Connection]

    @classmethod
    def join(cls, rank: int, size: int, store: dist.Store, device: torch.device,
             pipes: Sequence[Connection]) -> TensorParallelGroup:
        """Join the group; returns once every rank has (rank 0 creates the store, the others connect)."""
        messages = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, COLLECTIVE_TIMEOUT)
        device_group: Any = messages
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL
            device_group = nccl(dist.PrefixStore("nccl", store), rank, size, nccl.Options())
        return cls(rank, size, messages, device_group, pipes)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.device_group.allreduce([tensor]).wait()
        return tensor

    def send(self, command: str, tensors: Sequence[torch.Tensor] = (), **fields: Any) -> None:
        """Rank 0: tell every other rank what to do next, then broadcast the tensors it needs."""
        specs = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in tensors]
        header = json.dumps({"command": command, "tensors": specs, **fields}).encode()
        for pipe in self.pipes:
            pipe.send_bytes(header)
        for tensor in tensors:
            self.messages.broadcast(tensor.cpu().contiguous(), 0).wait()  # gloo's: host memory

    def receive(self, device: torch.device) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Ranks > 0: the next header from rank 0 and its tensors (on `device`). EOFError: rank 0 is gone."""
        header = json.loads(self.pipes[0].recv_bytes())
        tensors = []
        for shape, dtype in header.pop("tensors"):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device="cpu")
            self.messages.broadcast(tensor, 0).wait()
            tensors.append(tensor.to(device))
        return header, tensors

    def broadcast_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0: each checkpoint tensor, sent whole to the other ranks as it is read."""
        for name, tensor in weights:
            self.send("weight", [tensor.cpu()], name=name)
            yield name, tensor
        self.send("weights_loaded")

    def receive_weights(self, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks > 0: the checkpoint's tensors as rank 0 reads them, until it has sent the last."""
        while True:
            header, tensors = self.receive(device)
            if header["command"] == "weights_loaded":
                return
            yield header["name"], tensors[0]

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on each), in rank order, on rank 0; [] on the others."""
        tensor = tensor.cpu().contiguous()
        outputs = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else []
        self.messages.gather([outputs] if self.rank == 0 else [], [tensor],
                             _gather_options()).wait()
        return outputs

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()


def _gather_options() -> Any:
    options = dist.GatherOptions()
    options.rootRank = 0
    options.timeout = COLLECTIVE_TIMEOUT
    return options
