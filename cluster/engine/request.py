"""A request and its life in the engine.

Lifecycle: WAITING -> RUNNING -> (PREEMPTED -> WAITING/RUNNING)* -> one FINISHED_* state.
On a decode worker of the disaggregated cluster a request starts in WAITING_FOR_REMOTE_KV: its
blocks are reserved while a prefill worker sends the prompt's KV, then it joins the running batch.

The engine has no prefill or decode phase: each step, a scheduled request moves its
`num_computed_tokens` towards `num_tokens` (prompt plus outputs so far). When a step computes the
request's last known token, the model's sample for that position becomes the next output token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.common.events import FinishReason, TokenLogprobs
from cluster.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.grammar.matcher import GrammarMatcher


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KV = 3
    # Finished states last, so `status >= FINISHED_STOPPED` means finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + outputs, kept as one list so the runner slices it without concatenating.
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (for metrics).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # `sampling_params.prompt_logprobs`: those of prompt tokens 1, 2, ... computed so far (chunk by chunk).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    running_since: float | None = None  # when it first ran here (its time running, not waiting, is measured)
    remote_kv_time: float | None = None  # decode side: when its prompt's KV landed from a prefill worker
    # Decode side: leading prompt blocks found in this engine's prefix cache when its KV was reserved;
    # only the KV of the blocks after them comes from the prefill worker.
    num_reused_blocks: int = 0
    # Prefill side of the cluster: keep the blocks when the request ends, until they are exported.
    hold_kv: bool = False
    # Where the output stands in its grammar (`sampling_params.structured`); None: unconstrained.
    grammar: GrammarMatcher | None = None
    # Speculative decoding: tokens proposed to follow `all_token_ids`, verified when next scheduled.
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def num_prompt_logprobs_due(self) -> int:
        """Prompt logprobs asked and not computed yet (each prompt token's but the first's)."""
        if self.sampling_params.prompt_logprobs is None:
            return 0
        return max(0, self.num_prompt_tokens - 1 - len(self.prompt_logprobs))

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        """Every output token comes through here (sampled, or a prefill worker's first token), so the
        grammar's state always matches the output."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def drop_output_tokens(self, count: int) -> None:
        """Take back the last `count` output tokens: accepted drafts after a stop string, which the
        detokenizer finds only once the step appended them (never for a constrained request: its
        grammar has advanced past them, and it is never given drafts)."""
        assert self.grammar is None or count == 0
        if count:
            del self.output_token_ids[-count:]
            del self.all_token_ids[-count:]

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished state the last output token put this request in, or None to keep going.

        Stop strings are checked by the detokenizer, which sees text; this checks token ids.
        """
        params = self.sampling_params
        num_output = len(self.output_token_ids)
        if len(self.all_token_ids) >= max_model_len:  # before min_tokens: the context is full whatever it asks
            return RequestStatus.FINISHED_LENGTH
        if self.grammar is not None and (status := self._grammar_status()) is not None:
            return status  # before min_tokens too: a complete grammar allows no more tokens
        if num_output < params.min_tokens:
            return None
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _grammar_status(self) -> RequestStatus | None:
        assert self.grammar is not None
        if self.grammar.failed:  # a token from elsewhere the grammar refuses (the sampler never picks one)
            return RequestStatus.FINISHED_ERROR
        if self.grammar.finished:
            return RequestStatus.FINISHED_STOPPED
        return None
