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


def joined(events: list[TokenEvent]) -> TokenEvent:
    """Consecutive events of one request as one (a reader that lagged reads them at once): the news
    of all, the state of the last; prompt logprobs come with the first token only."""
    first, last = events[0], events[-1]
    if len(events) == 1:
        return first
    return TokenEvent(last.request_id, first.index, [token for event in events for token in event.token_ids],
                      "".join(event.text for event in events), last.finished, last.finish_reason,
                      last.num_prompt_tokens, last.worker_id, max(event.num_cached_tokens for event in events),
                      [logprobs for event in events for logprobs in event.logprobs], first.prompt_logprobs)


def follows(event: TokenEvent, before: TokenEvent) -> bool:
    """`event` goes on where `before` ended (so the two can be joined): same request, next index."""
    return (not before.finished and event.request_id == before.request_id
            and event.index == before.index + len(before.token_ids))
