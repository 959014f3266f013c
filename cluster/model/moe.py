"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral: a router and a stack of SwiGLU experts.

Each token goes to its top-k experts. Rather than scan the routing once per expert for its tokens
(transformers' loop: a `where`, a gather and an `index_add_` per expert), the step's (token, slot)
pairs are sorted by expert once, so each expert's rows are one contiguous run of a single gathered
copy of the tokens:

    expert ids [tokens, k] ──flatten, stable argsort──> order          (pairs grouped by expert)
    x[order // k]          ──expert e over its run────> rows [tokens * k, hidden]
    rows * weights         ──index_add_ by token──────> out [tokens, hidden]

On CPUs, where torch has `functional.grouped_mm` and the rows' strides are multiples of 16 bytes (its
requirement), all runs go through one grouped matmul for gate/up and one for down, the run lengths
passed as offsets: no host sync, and no per-expert dispatch, which is what a layer of many small
experts spends its time on (benchmarks/moe.py). Elsewhere (GPUs, where it is untested here, older
torch, odd widths) a loop runs one gate/up and one down matmul per expert that some token chose, after
one host sync for the run lengths. Neither computes anything for an expert no token chose.

Parameter names and shapes are transformers' own in-memory layout: `gate.weight` [experts, hidden],
`experts.gate_up_proj` [experts, 2 * inter, hidden] (gate rows first), `experts.down_proj`
[experts, hidden, inter]; `MoeForCausalLM.load_weights` maps per-expert checkpoint tensors onto them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from cluster.model import elementwise
from cluster.model.architecture import MoeConfig

# False: the per-expert loop wherever the grouped matmul would serve too (the tests and the benchmark
# compare both).
use_grouped_mm = True
_grouped_mm = getattr(functional, "grouped_mm", None)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), both [tokens, top_k], best first: softmax in fp32 over the router's
    logits, its top k, rescaled to sum to 1 where `renormalize`; weights in the logits' dtype."""
    probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def sorted_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                   experts: torch.Tensor) -> torch.Tensor:
    """Σ over each token's k experts of weight * down(silu(gate) * up): x [tokens, hidden], gate_up
    [experts, 2 * inter, hidden], down [experts, hidden, inter], weights and experts [tokens, k]."""
    top_k = experts.shape[1]
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k  # the token of each pair, in expert order
    runs = torch.bincount(flat, minlength=gate_up.shape[0])
    grouped = x[tokens]
    if grouped_mm_serves(grouped, gate_up, down):
        rows = grouped_runs(grouped, gate_up, down, runs)
    else:
        rows = expert_runs(grouped, gate_up, down, runs.tolist())
    rows *= weights.flatten()[order].unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, tokens, rows)


def grouped_mm_serves(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `grouped_runs` serves: a CPU tensor, torch has the grouped matmul, and every row stride it
    sees (hidden and expert widths) is a multiple of 16 bytes."""
    if not use_grouped_mm or _grouped_mm is None or x.device.type != "cpu":
        return False
    return all(size * x.element_size() % 16 == 0 for size in (gate_up.shape[2], down.shape[2]))


def grouped_runs(grouped: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, runs: torch.Tensor) -> torch.Tensor:
    """`expert_runs` in two grouped matmuls: the runs' ends as offsets, each run against its expert."""
    assert _grouped_mm is not None
    offsets = runs.cumsum(0).to(torch.int32)
    hidden = elementwise.silu_mul(_grouped_mm(grouped, gate_up.transpose(1, 2), offs=offsets))
    return _grouped_mm(hidden, down.transpose(1, 2), offs=offsets)


def expert_runs(grouped: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, runs: list[int]) -> torch.Tensor:
    """Each expert's SwiGLU over its run of `grouped`'s rows (runs[e] rows for expert e, in order)."""
    out = torch.empty_like(grouped)
    start = 0
    for expert, count in enumerate(runs):
        if count:
            end = start + count
            hidden = elementwise.silu_mul(functional.linear(grouped[start:end], gate_up[expert]))
            out[start:end] = functional.linear(hidden, down[expert])
            start = end
    return out


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return sorted_experts(x, self.gate_up_proj, self.down_proj, weights, experts)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: x [tokens, hidden] to [tokens, hidden], as the dense `MLP`."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden_size, moe.intermediate_size)
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, experts)
