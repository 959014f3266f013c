"""The soak: mixed traffic against an HTTP gateway for a while, and an account of every request.

`run_soak(url, SoakConfig(duration_s=30))` keeps `concurrency` clients busy until the time is up,
then lets the requests in flight end. Each client sends one request after another, each of a kind
drawn (seeded) from `KINDS`: completions and chats, whole or streamed, random `max_tokens`,
temperatures, stops and logprobs; streams the client drops after a few chunks; requests it cancels
after a random delay (queued, mid-prompt or mid-answer, wherever they are then); invalid requests.
Every request ends with exactly one outcome:

- `finished`: a 200 answer, whole JSON or a stream to `[DONE]`, whose tokens add up (at least one,
  at most `max_tokens`, exactly `max_tokens` when EOS was ignored and no stop string was given);
- `error`: an explicit refusal: an error status with OpenAI's error JSON (429 when the queues are
  full, 400/404 for the invalid kinds), or an error event inside a stream;
- `aborted`: the client gave up on purpose (dropped the stream, cancelled the request);
- `unexpected`: anything else: a 5xx, a stream without `[DONE]`, a valid request refused with a 4xx
  or an invalid one accepted, token counts that do not add up, a read that failed. A soak exists to
  find these; `SoakRecord.detail` says what happened.

The server's side (KV pool whole, nothing left running, memory) is the caller's to check:
`tests/serving/http/test_soak.py` (30 s on a tiny model, `PDSERVE_SOAK_S`) and `benchmarks/soak.py`
(longer, a JSON summary). Only httpx and numpy are imported: this module runs without torch.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FINISHED, ERROR, ABORTED, UNEXPECTED = "finished", "error", "aborted", "unexpected"
OUTCOMES = (FINISHED, ERROR, ABORTED, UNEXPECTED)
# The kinds of request, with how often each is drawn.
KINDS: dict[str, float] = {
    "completion": 2, "chat": 2, "completion-stream": 2, "chat-stream": 2,
    "disconnect": 1.5,  # a stream the client closes after a few chunks
    "cancel": 1.5,  # a request the client cancels after a random delay (it may finish first)
    "invalid": 1,
}
WORDS = ("the", "capital", "of", "France", "is", "Paris", "Italy", "Rome", "Spain", "hello", "world", "how", "are",
         "you", "doing", "today", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "numbers", "print", "what")
# Bodies no gateway may accept, each with the status it must answer. None: a malformed JSON body.
INVALID: tuple[tuple[str, dict[str, Any] | None, int], ...] = (
    ("/v1/completions", {"prompt": "hello", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hello", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hello", "model": "no-such-model"}, 404),
    ("/v1/completions", None, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hello"}]}, 400),
)


@dataclass(frozen=True, slots=True)
class SoakConfig:
    duration_s: float = 30.0  # new requests start until then; those in flight then still end
    concurrency: int = 12  # clients, each with one request in flight at a time
    seed: int = 0
    max_tokens: int = 32  # drawn from 1..this (less when the context is shorter)
    max_prompt_words: int = 40
    think_s: float = 0.02  # a client's pause between requests, drawn from 0..this
    retry_pause_s: float = 0.1  # after a 429 (a real client would honour Retry-After)
    max_cancel_s: float = 0.5  # a cancelled request is cancelled after 0..this
    timeout_s: float = 300.0  # a request not over by then is unexpected
    api_key: str | None = None

    def __post_init__(self) -> None:
        if self.duration_s < 0 or self.concurrency < 1 or self.max_tokens < 1 or self.max_prompt_words < 1:
            raise ValueError("duration_s must be >= 0, concurrency, max_tokens and max_prompt_words >= 1")


@dataclass(frozen=True, slots=True)
class SoakRequest:
    """One request to send, and what its answer must be."""

    kind: str
    path: str
    body: dict[str, Any] | None  # None: send a malformed JSON body
    stream: bool = False
    expect_status: int = 200
    max_tokens: int = 0
    exact_tokens: bool = False  # EOS ignored and no stop string: exactly max_tokens
    disconnect_after: int = 0  # data chunks to read before closing the stream (0: read it all)
    cancel_after_s: float | None = None


@dataclass(slots=True)
class SoakRecord:
    kind: str
    outcome: str = UNEXPECTED
    status: int | None = None  # None: no status line came (cancelled before it, or a failed read)
    tokens: int = 0  # completion tokens of a finished request
    latency_s: float = 0.0
    first_chunk_s: float | None = None  # streams: when the first data chunk came
    detail: str = ""


@dataclass(slots=True)
class SoakReport:
    records: list[SoakRecord]
    duration_s: float  # from the first request to the end of the last

    def by_outcome(self) -> dict[str, int]:
        counts = collections.Counter(record.outcome for record in self.records)
        return {outcome: counts[outcome] for outcome in OUTCOMES}

    def unexpected(self) -> list[SoakRecord]:
        return [record for record in self.records if record.outcome == UNEXPECTED]

    def summary(self) -> dict[str, Any]:
        finished = [record for record in self.records if record.outcome == FINISHED]
        tokens = sum(record.tokens for record in finished)
        first_chunks = [r.first_chunk_s for r in finished if r.first_chunk_s is not None]
        return {
            "requests": len(self.records), "duration_s": round(self.duration_s, 3),
            "by_outcome": self.by_outcome(),
            "by_kind": {kind: _outcomes_of(self.records, kind) for kind in KINDS},
            "errors_by_status": dict(collections.Counter(str(r.status) for r in self.records if r.outcome == ERROR)),
            "completion_tokens": tokens, "tokens_per_s": round(tokens / self.duration_s, 2) if self.duration_s else 0,
            "latency_ms": _percentiles([record.latency_s for record in finished]),
            "first_chunk_ms": _percentiles(first_chunks),
            "unexpected": [f"{r.kind}: status {r.status}: {r.detail}" for r in self.unexpected()[:20]],
        }


def _outcomes_of(records: Sequence[SoakRecord], kind: str) -> dict[str, int]:
    counts = collections.Counter(record.outcome for record in records if record.kind == kind)
    return {outcome: count for outcome, count in counts.items() if count}


def _percentiles(seconds: Sequence[float]) -> dict[str, float | None]:
    if not seconds:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(seconds) * 1000, [50, 99])
    return {"p50": round(float(p50), 1), "p99": round(float(p99), 1)}


def rss_bytes() -> int:
    """This process's resident memory now (Linux); elsewhere its peak, which only grows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- drawing requests ------------------------------------------------------------------------------


class RequestMaker:
    """Draws requests that fit the served model's context."""

    def __init__(self, config: SoakConfig, model: str, max_model_len: int, seed: int) -> None:
        self.config, self.model, self.rng = config, model, random.Random(seed)
        # A prompt word is at most a few tokens, a chat template a few dozen: stay well inside.
        self.max_tokens = max(1, min(config.max_tokens, max_model_len // 4))
        self.max_words = max(1, min(config.max_prompt_words, max_model_len // 8))
        self.kinds, self.weights = list(KINDS), list(KINDS.values())

    def draw(self, kind: str | None = None) -> SoakRequest:
        kind = kind or self.rng.choices(self.kinds, self.weights)[0]
        if kind == "invalid":
            path, body, status = self.rng.choice(INVALID)
            return SoakRequest(kind, path, body, expect_status=status)
        chat = kind.startswith("chat") or (kind in ("disconnect", "cancel") and self.rng.random() < 0.5)
        stream = kind.endswith("stream") or kind == "disconnect" or (kind == "cancel" and self.rng.random() < 0.5)
        body, exact = self._body(chat, stream)
        return SoakRequest(kind, "/v1/chat/completions" if chat else "/v1/completions", body, stream,
                           max_tokens=body["max_tokens"], exact_tokens=exact,
                           disconnect_after=self.rng.randint(1, 3) if kind == "disconnect" else 0,
                           cancel_after_s=self.rng.uniform(0, self.config.max_cancel_s) if kind == "cancel" else None)

    def _body(self, chat: bool, stream: bool) -> tuple[dict[str, Any], bool]:
        rng = self.rng
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, self.max_words)))
        body: dict[str, Any] = {"model": self.model, "max_tokens": rng.randint(1, self.max_tokens),
                                "temperature": rng.choice([0.0, 0.0, 0.8]), "ignore_eos": rng.random() < 0.7}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
            if rng.random() < 0.2:
                body["logprobs"] = 2
        if rng.random() < 0.1:
            body["stop"] = [" the"]
        if body["temperature"] and rng.random() < 0.5:
            body["seed"] = rng.randint(0, 1000)
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body, body["ignore_eos"] and "stop" not in body


# ---- sending them ----------------------------------------------------------------------------------


async def send(client: Any, request: SoakRequest) -> SoakRecord:
    """Send one request (an `httpx.AsyncClient`) and say how it ended."""
    record = SoakRecord(request.kind)
    started = time.monotonic()
    try:
        if request.cancel_after_s is None:
            await _exchange(client, request, record, started)
        else:
            await asyncio.wait_for(_exchange(client, request, record, started), request.cancel_after_s)
    except TimeoutError:
        record.outcome, record.detail = ABORTED, f"cancelled after {request.cancel_after_s:.3f}s"
    except Exception as error:  # a failed connection or read: nothing a client should see
        record.outcome, record.detail = UNEXPECTED, f"{type(error).__name__}: {error}"
    record.latency_s = time.monotonic() - started
    return record


async def _exchange(client: Any, request: SoakRequest, record: SoakRecord, started: float) -> None:
    if request.body is None:
        content, headers = b"{not json", {"Content-Type": "application/json"}
    else:
        content, headers = json.dumps(request.body).encode(), {"Content-Type": "application/json"}
    async with client.stream("POST", request.path, content=content, headers=headers) as response:
        record.status = response.status_code
        if response.status_code != 200:
            _judge_refusal(request, record, await response.aread())
        elif request.stream:
            await _read_stream(response, request, record, started)
        else:
            _judge_answer(request, record, json.loads(await response.aread()))


def _judge_refusal(request: SoakRequest, record: SoakRecord, body: bytes) -> None:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        record.detail = f"not OpenAI's error JSON: {body[:200]!r}"
        return
    record.detail = message
    expected = request.expect_status == record.status or (request.expect_status == 200 and record.status == 429)
    record.outcome = ERROR if expected else UNEXPECTED


def _judge_answer(request: SoakRequest, record: SoakRecord, answer: dict[str, Any]) -> None:
    if request.expect_status != 200:
        record.detail = f"an invalid request was accepted: {request.body}"
        return
    choice, usage = answer["choices"][0], answer["usage"]
    _judge_tokens(request, record, choice.get("finish_reason"), usage["completion_tokens"])


def _judge_tokens(request: SoakRequest, record: SoakRecord, finish_reason: str | None, tokens: int) -> None:
    record.tokens = tokens
    if finish_reason not in ("length", "stop"):
        record.detail = f"finish_reason {finish_reason!r}"
    elif not 1 <= tokens <= request.max_tokens:
        record.detail = f"{tokens} tokens for max_tokens {request.max_tokens}"
    elif request.exact_tokens and (tokens, finish_reason) != (request.max_tokens, "length"):
        record.detail = f"{tokens} tokens ({finish_reason}) for max_tokens {request.max_tokens}, EOS ignored"
    else:
        record.outcome = FINISHED


async def _read_stream(response: Any, request: SoakRequest, record: SoakRecord, started: float) -> None:
    finish_reasons: list[str] = []
    tokens, chunks = None, 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            if record.outcome == ERROR:
                return
            _judge_tokens(request, record, finish_reasons[-1] if finish_reasons else None, tokens or 0)
            if len(finish_reasons) != 1 or tokens is None:
                record.outcome = UNEXPECTED
                record.detail = f"finish reasons {finish_reasons}, usage {tokens}: {record.detail}"
            return
        chunk = json.loads(data)
        if "error" in chunk:
            record.outcome, record.detail = ERROR, f"in-band: {chunk['error']['message']}"
            continue  # [DONE] still follows
        chunks += 1
        if record.first_chunk_s is None:
            record.first_chunk_s = time.monotonic() - started
        finish_reasons += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunks == request.disconnect_after:
            record.outcome, record.detail = ABORTED, f"closed after {chunks} chunks"
            return  # leaving the `stream` block closes the connection mid-stream
    if record.outcome != ERROR:
        record.outcome, record.detail = UNEXPECTED, "the stream ended without [DONE]"


# ---- the soak --------------------------------------------------------------------------------------


async def run_soak(url: str, config: SoakConfig) -> SoakReport:
    """Drive the gateway at `url` with `config.concurrency` clients for `config.duration_s`."""
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=30, headers=headers) as client:
        (card,) = (await client.get("/v1/models")).raise_for_status().json()["data"]
    records: list[SoakRecord] = []
    started = time.monotonic()
    deadline = started + config.duration_s
    await asyncio.gather(*(_client(url, config, index, card, deadline, records, headers)
                           for index in range(config.concurrency)))
    return SoakReport(records, time.monotonic() - started)


async def _client(url: str, config: SoakConfig, index: int, card: dict[str, Any], deadline: float,
                  records: list[SoakRecord], headers: dict[str, str]) -> None:
    """One client's requests until the deadline. Client i starts with kind i, so that a short soak
    still sends every kind."""
    import httpx

    maker = RequestMaker(config, card["id"], card["max_model_len"], seed=config.seed * 10_000 + index)
    kind: str | None = list(KINDS)[index % len(KINDS)]
    async with httpx.AsyncClient(base_url=url, timeout=config.timeout_s, headers=headers) as client:
        while time.monotonic() < deadline or kind is not None:
            record = await send(client, maker.draw(kind))
            records.append(record)
            kind = None
            pause = config.retry_pause_s if record.status == 429 else maker.rng.uniform(0, config.think_s)
            await asyncio.sleep(pause)
