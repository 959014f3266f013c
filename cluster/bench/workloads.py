"""What a serving benchmark sends: workloads.

A workload is a list of `Conversation`s, each one or more turns (`BenchRequest`s) sent one after
another: turn k+1 leaves once turn k's answer has ended. The arrival process schedules the starts
of conversations; for single-turn workloads that is the request rate.

Workloads:

- `synthetic`: random token ids as prompts (the completions endpoint takes a list of ints), input
  and output lengths drawn from lognormal distributions. With `ignore_eos` the output length is
  exactly `max_tokens`.
- `shared-prefix`: every conversation opens with the same system prompt; each turn appends a user
  message and resends the whole history. The assistant's earlier replies in that history are
  stand-ins of the length the server was asked to produce (the same in both drivers, and
  reproducible): a prefix cache can match the history up to the previous turn's prompt.
- `long-mix`: a share of long prompts among synthetic streaming requests: the load that exposes a
  scheduler's token budget (long prefills sharing steps with decodes).
- `file`: conversations from a JSONL file, one `{"messages": [...]}` per line, sent to the chat
  endpoint (a trailing assistant message is dropped: it is the reference answer, not the prompt).
  A line's optional `max_tokens` sets its output length; otherwise it is drawn as for `synthetic`.

When each conversation starts is `cluster.bench.arrivals`' business.

The cluster benchmarks (`cluster.bench.cluster_runs`: token ids straight to a `Cluster`, no HTTP)
send `TimedRequest`s: a request with its id, its class and its planned arrival. `timed_requests`
gives one to each arrival time, with prompt and output lengths drawn uniformly (`RequestShape`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = ("synthetic", "shared-prefix", "long-mix", "file")
Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: token ids (completions endpoint) or chat messages (chat endpoint)."""

    prompt: list[int] | list[Message]
    max_tokens: int
    tag: str = ""  # the class of request, kept in its record ("long", "short", "turn-2", ...)

    @property
    def is_chat(self) -> bool:
        return bool(self.prompt) and isinstance(self.prompt[0], dict)

    @property
    def prompt_len(self) -> int:
        """Prompt tokens, when known before sending (token ids); 0 for chat."""
        return 0 if self.is_chat else len(self.prompt)


@dataclass(frozen=True, slots=True)
class Conversation:
    turns: list[BenchRequest]


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Lengths are medians of lognormal distributions with the given sigma (0: fixed lengths)."""

    kind: str = "synthetic"
    num_requests: int = 64  # requests in all (turns of conversations included)
    input_len: int = 128
    output_len: int = 64
    input_sigma: float = 0.5
    output_sigma: float = 0.5
    prefix_len: int = 512  # shared-prefix: the system prompt's tokens
    turns: int = 3  # shared-prefix: turns per conversation
    long_len: int = 2048  # long-mix: the long prompts' tokens
    long_fraction: float = 0.25  # long-mix: their share of the requests
    dataset: str = ""  # file: the JSONL path
    token_range: tuple[int, int] = (1000, 30000)  # token ids drawn from [low, high): ordinary vocabulary
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"the workload must be one of {', '.join(WORKLOADS)}, got {self.kind!r}")
        if self.num_requests < 1 or self.input_len < 1 or self.output_len < 1 or self.turns < 1:
            raise ValueError("num_requests, input_len, output_len and turns must be at least 1")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long_fraction must be within [0, 1], got {self.long_fraction}")
        low, high = self.token_range
        if not 0 <= low < high:
            raise ValueError(f"the token id range must be LOW:HIGH with 0 <= LOW < HIGH, got {low}:{high}")
        if self.kind == "file" and not self.dataset:
            raise ValueError("the file workload needs a dataset: a JSONL file of {\"messages\": [...]} lines")


@dataclass(frozen=True, slots=True)
class TimedRequest:
    """One request of a cluster benchmark: random token ids, sent at `arrival_s` from the run's start,
    greedy, EOS ignored (exactly `max_tokens` come back)."""

    request_id: str
    kind: str  # the class of request, kept in its record ("short", "long", ...)
    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class RequestShape:
    """Prompt and output lengths drawn uniformly from [low, high] (both included; low == high: fixed,
    nothing drawn), token ids from `token_range`."""

    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    kind: str = "short"
    token_range: tuple[int, int] = (1000, 30000)


def timed_requests(rng: np.random.Generator, arrivals: Sequence[float], shape: RequestShape,
                   id_prefix: str = "r") -> list[TimedRequest]:
    """One request per arrival, ids `{id_prefix}{index}`; per request its prompt length, its ids,
    then its output length are drawn, in that order."""
    requests = []
    for index, at in enumerate(arrivals):
        prompt = random_tokens(rng, _uniform(rng, shape.prompt_len), shape.token_range)
        requests.append(TimedRequest(f"{id_prefix}{index}", shape.kind, at, prompt, _uniform(rng, shape.output_len)))
    return requests


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return low if low == high else int(rng.integers(low, high + 1))


def build_workload(config: WorkloadConfig) -> list[Conversation]:
    rng = np.random.default_rng(config.seed)
    if config.kind == "shared-prefix":
        return shared_prefix(config, rng)
    if config.kind == "long-mix":
        return long_prompt_mix(config, rng)
    if config.kind == "file":
        return from_file(config, rng)
    return [Conversation([request]) for request in synthetic(config, rng, config.num_requests)]


def lognormal_lengths(rng: np.random.Generator, median: int, sigma: float, count: int) -> list[int]:
    """Lognormal lengths around `median`, clipped to [1, 8 * median] (a bounded tail)."""
    if sigma == 0:
        return [median] * count
    lengths = np.round(rng.lognormal(math.log(median), sigma, count))
    return [int(n) for n in np.clip(lengths, 1, 8 * median)]


def random_tokens(rng: np.random.Generator, count: int, token_range: tuple[int, int]) -> list[int]:
    return [int(t) for t in rng.integers(token_range[0], token_range[1], count)]


def synthetic(config: WorkloadConfig, rng: np.random.Generator, count: int, tag: str = "") -> list[BenchRequest]:
    inputs = lognormal_lengths(rng, config.input_len, config.input_sigma, count)
    outputs = lognormal_lengths(rng, config.output_len, config.output_sigma, count)
    return [BenchRequest(random_tokens(rng, n, config.token_range), m, tag)
            for n, m in zip(inputs, outputs, strict=True)]


def shared_prefix(config: WorkloadConfig, rng: np.random.Generator) -> list[Conversation]:
    """ceil(num_requests / turns) conversations; the last one is cut so the total is num_requests."""
    system = random_tokens(rng, config.prefix_len, config.token_range)
    conversations, remaining = [], config.num_requests
    while remaining > 0:
        turns = min(config.turns, remaining)
        users = synthetic(config, rng, turns)
        history, requests = list(system), []
        for index, user in enumerate(users):
            history += user.prompt  # type: ignore[arg-type]  # token ids, from `synthetic`
            requests.append(BenchRequest(list(history), user.max_tokens, f"turn-{index + 1}"))
            history += random_tokens(rng, user.max_tokens, config.token_range)  # the reply's stand-in
        conversations.append(Conversation(requests))
        remaining -= turns
    return conversations


def long_prompt_mix(config: WorkloadConfig, rng: np.random.Generator) -> list[Conversation]:
    """`long_fraction` of the requests have prompts of `long_len` tokens, the rest are synthetic;
    both draw their outputs from the same distribution. Shuffled, so long prompts come at random."""
    num_long = round(config.num_requests * config.long_fraction)
    outputs = lognormal_lengths(rng, config.output_len, config.output_sigma, num_long)
    requests = [BenchRequest(random_tokens(rng, config.long_len, config.token_range), m, "long") for m in outputs]
    requests += synthetic(config, rng, config.num_requests - num_long, "short")
    order = rng.permutation(len(requests))
    return [Conversation([requests[i]]) for i in order]


def from_file(config: WorkloadConfig, rng: np.random.Generator) -> list[Conversation]:
    """The file's conversations in order, cycled to num_requests."""
    entries = read_conversations(config.dataset)
    outputs = lognormal_lengths(rng, config.output_len, config.output_sigma, config.num_requests)
    conversations = []
    for index in range(config.num_requests):
        messages, max_tokens = entries[index % len(entries)]
        conversations.append(Conversation([BenchRequest(messages, max_tokens or outputs[index], "chat")]))
    return conversations


def read_conversations(path: str) -> list[tuple[list[Message], int | None]]:
    """(messages, max_tokens or None) per line; blank lines skipped; ValueError naming the bad line."""
    entries = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            entries.append(_conversation_of(line, f"{path}:{number}"))
    if not entries:
        raise ValueError(f"{path} holds no conversation: one {{\"messages\": [...]}} object per line")
    return entries


def _conversation_of(line: str, where: str) -> tuple[list[Message], int | None]:
    try:
        entry: Any = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON ({error})") from None
    messages = entry.get("messages") if isinstance(entry, dict) else None
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"{where}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}")
    messages = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in messages]
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise ValueError(f"{where}: no message to send")
    max_tokens = entry.get("max_tokens")
    return messages, int(max_tokens) if max_tokens else None


def total_requests(conversations: Sequence[Conversation]) -> int:
    return sum(len(conversation.turns) for conversation in conversations)
