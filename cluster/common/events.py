"""What a request's tokens look like when they leave the engine: `TokenEvent`s, one per step and
request, carrying only what is new. Workers make them, the router relays them across Ray, the
service hands them to the front doors, which format them as OpenAI chunks or gRPC messages."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probability of a sampled token and the top-N alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 0  # the token's rank among the vocabulary (1: the most likely); 0: not computed


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step's news about a request, as it crosses process boundaries: a diff, never the whole
    output again. `index` is how many output tokens came before `token_ids`."""

    request_id: str
    index: int  # how many output tokens came before these
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    worker_id: str
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token in `token_ids`, if asked
    # With the first token, if asked: one per prompt token, None for the first (it has no context).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
