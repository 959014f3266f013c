"""What one scheduler step decides, handed to the model runner: the requests to run and how many
tokens each, the blocks to swap out and in, and the requests preempted."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.engine.host_tier import HostCopies
from cluster.engine.request import Request

__all__ = ["HostCopies", "ScheduledRequest", "SchedulerOutput", "SwapOrder"]  # HostCopies: for the runner


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]
    # Whether this step reaches the request's last known token, so the model's sample is kept.
    samples: bool
    # Drafts run after the request's last token (the last `len(draft_token_ids)` of `num_new_tokens`).
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SwapOrder:
    request_id: str
    block_ids: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    # Copies the runner makes before the forward pass: out of freed blocks, into new ones.
    swap_out: list[SwapOrder] = field(default_factory=list)
    swap_in: list[SwapOrder] = field(default_factory=list)
    # Copies between the pool and the host tier, made first: blocks evicted or promoted this step.
    host_copies: HostCopies = field(default_factory=HostCopies)

    @property
    def empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.host_copies

