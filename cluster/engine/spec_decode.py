"""Speculative decoding, the engine's side: who proposes draft tokens, and what was accepted.

A decoding request with drafts runs as one row of 1 + d query tokens over its cached KV: its last
token and the d drafts. The model's distribution at each of those positions verifies the drafts
(`cluster.model.rejection_sampler`), and the step appends the accepted drafts and one token of the
model's own: 1 to d + 1 tokens. The KV of rejected drafts stays in slots past the request's tokens,
which its next tokens overwrite; the prefix cache only ever registers blocks of real tokens.

Proposers are called by `LLMEngine` after each step, for the requests that step advanced and that
decode next; the drafts wait on `Request.draft_token_ids` until the scheduler runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from cluster.common.errors import QueueFullError
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import SpeculativeConfig
from cluster.engine.request import Request

if TYPE_CHECKING:
    from cluster.engine.llm_engine import LLMEngine


class Proposer(Protocol):
    """Proposes each request's next tokens. Drafts are guesses: wrong ones cost a wasted query
    position, never a wrong token."""

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[list[int]]:
        """At most `max_drafts[i]` drafts for `requests[i]`, following its `all_token_ids`."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): the tokens that followed the longest earlier match of the
    request's last `min_n`..`max_n` tokens (its earliest occurrence), in its prompt and output."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[list[int]]:
        return [ngram_lookup(request.all_token_ids, self.min_n, self.max_n, k) if k > 0 else []
                for request, k in zip(requests, max_drafts, strict=True)]


def ngram_lookup(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the longest n-gram (min_n <= n <= max_n) ending `tokens` found
    earlier in them, at its earliest occurrence; [] when none matches."""
    if len(tokens) <= min_n or k <= 0:
        return []
    array = np.asarray(tokens)
    # Candidate match ends: earlier positions holding the last token (one token must follow each).
    ends = np.flatnonzero(array[:-1] == array[-1])
    if ends.size == 0:
        return []
    length = np.ones(ends.size, np.int64)
    matching = np.ones(ends.size, bool)
    for back in range(1, min(max_n, len(tokens) - 1)):
        inside = ends >= back
        matching &= inside & (array[np.where(inside, ends - back, 0)] == array[-1 - back])
        length += matching
    best = int(length.max())
    if best < min_n:
        return []
    end = int(ends[np.argmax(length == best)])  # argmax: the first, so the earliest occurrence
    return array[end + 1:end + 1 + k].tolist()


class DraftModelProposer:
    """A smaller model's greedy continuation of each request (vLLM's "draft_model").

    The draft model runs in an engine of its own (its paged KV cache, its prefix cache) on the served
    model's device. Each round gives it every request's tokens as a prompt and runs it to that
    request's number of drafts: its prefix cache holds the full blocks of the round before, so a round
    computes the tokens since then (the last partial block included) and one decode step per draft.
    Greedy drafts are point masses, as n-gram drafts are, so the rejection sampler's verification keeps
    the served model's distribution. A draft id outside the served model's vocabulary ends a row's drafts.
    """

    def __init__(self, engine: LLMEngine, vocab_size: int) -> None:
        self.engine, self.vocab_size = engine, vocab_size

    def propose(self, requests: Sequence[Request], max_drafts: Sequence[int]) -> list[list[int]]:
        drafted: dict[str, list[int]] = {}
        for request, k in zip(requests, max_drafts, strict=True):
            if k > 0 and self._add(request, k):
                drafted[_draft_id(request)] = []
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                drafted[output.request_id] = list(output.token_ids)
        return [self._in_vocab(drafted.get(_draft_id(request), [])) for request in requests]

    def _add(self, request: Request, k: int) -> bool:
        """Queue the request's tokens on the draft engine; False where it cannot run them (a context
        shorter than the served model's, tokens outside its vocabulary, a full queue)."""
        if len(request.all_token_ids) + k > self.engine.max_model_len:
            return False
        params = SamplingParams(max_tokens=k, temperature=0, ignore_eos=True,
                                cache_domain=request.sampling_params.cache_domain)
        try:
            self.engine.add_request(request.all_token_ids, params, request_id=_draft_id(request))
        except (ValueError, QueueFullError):
            return False
        return True

    def _in_vocab(self, drafts: list[int]) -> list[int]:
        for position, token_id in enumerate(drafts):
            if token_id >= self.vocab_size:
                return drafts[:position]
        return drafts


def _draft_id(request: Request) -> str:
    return f"draft-{request.request_id}"


def build_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The n-gram proposer; the draft model's is the engine's to build (it loads a model)."""
    if config.method == "ngram":
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return None


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's speculative decoding counters: rows verified with drafts, drafts, drafts accepted, and
    how often the draft at each position was accepted (position 0 first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_position))
