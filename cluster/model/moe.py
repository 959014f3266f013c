"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral: a router and a stack of SwiGLU experts.

Each token goes to its top-k experts. Rather than run every expert over a mask of the batch (work for
all experts, a `where` per expert), the step's (token, slot) pairs are sorted by expert, so each
expert's rows are one contiguous run of a single gathered copy of the tokens:

    expert ids [tokens, k] ──flatten, stable argsort──> order          (pairs grouped by expert)
    x[order // k]          ──expert e over its run────> rows [tokens * k, hidden]
    rows * weights         ──index_add_ by token──────> out [tokens, hidden]

One gate/up matmul and one down matmul per expert that some token chose, none for the others; one
host sync a layer (the run lengths). `torch._grouped_mm` computes the same runs in one call, but on
CPUs it is the same loop inside (benchmarks/moe.py measures both), so the loop serves every device
and dtype.

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
    runs = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = expert_runs(x[tokens], gate_up, down, runs)
    rows *= weights.flatten()[order].unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, tokens, rows)


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
