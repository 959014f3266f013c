"""The Python SDK for pdserve's gRPC API: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("localhost:50051") as client:
        for chunk in client.generate("Once upon a time", max_tokens=32):
            print(chunk.text, end="", flush=True)

A prompt is text, a list of token ids, or a chat (a list of {"role": ..., "content": ...} dicts);
sampling options are `SamplingParams`' fields as keywords (`structured` takes a `StructuredOutput`, or
the message's fields as a dict: `structured={"regex": "[0-9]+"}`). Failures raise `ClientError`, which
carries the gRPC status code.

`n=3` asks three choices: a stream's chunks carry their `choice`, and a `Completion` has them all in
`choices` (the first also at its top). A chat may offer tools as OpenAI's API does: `tools=[{"type":
"function", "function": {"name", "description", "parameters"}}]` (or the inner dicts), `tool_choice`
("auto", "none", "required" or {"function": {"name": ...}}) and `parallel_tool_calls`; the calls come
back parsed (`Completion.tool_calls`, `Chunk.tool_calls` deltas), and a chat message may carry an
assistant's `tool_calls` and a tool's `tool_call_id`. `cache_salt="..."` (vLLM's) shares prefix-cache
blocks only with requests of the same salt.

Retries: a call failing with UNAVAILABLE (server starting, draining, restarting, unreachable) is
tried again with exponential backoff, up to `max_attempts` in all, but a stream never once a token
has arrived: the caller has seen output that a second attempt would repeat. Other codes are final
(RESOURCE_EXHAUSTED, say, is the server asking for less load, not for more calls).

Deadlines: `timeout` (seconds, per client or per call) bounds the whole call, retries included.
Cancellation: leaving a stream early (`break` then `close()`, or the end of its `with` block)
cancels the call, and the server frees the request's KV cache at once.

Only grpc and the generated stubs are imported: the SDK does not load torch.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.common import env
from cluster.common.structured_output import StructuredOutput
from cluster.grpc_stubs import pdserve_pb2 as pb
from cluster.grpc_stubs import pdserve_pb2_grpc

__all__ = ["AsyncClient", "AsyncStream", "Choice", "Chunk", "Client", "ClientError", "Completion", "Model", "Prompt",
           "Stream", "TokenLogprob", "ToolCall", "ToolCallDelta", "Usage"]

DEFAULT_TARGET = "localhost:50051"
MAX_ATTEMPTS = 5
BACKOFF_S = 0.2  # before the second attempt; doubles each time, up to BACKOFF_MAX_S
BACKOFF_MAX_S = 2.0

# While a channel waits out its reconnect backoff (1 s, growing to 2 min, by default), every call on
# it fails at once with UNAVAILABLE, retries included: reconnect often, so retries find a server
# that came back.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
TOOL_CHOICE_MODES = ("auto", "none", "required")


# ---- what calls return ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int  # prompt tokens the server found in its prefix cache


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the most likely tokens, most likely first


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a choice's call `index`: the first has `id` and `name`, the others extend `arguments`."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Chunk:
    """One message of a stream: the tokens and text added since the previous one."""

    request_id: str
    index: int  # how many output tokens came before `token_ids`
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # on the last chunk: "stop", "length", "abort" or "error"
    logprobs: list[TokenLogprob]  # one per token, when asked for with `logprobs=N`
    usage: Usage | None  # on the choice's last chunk: the prompt and that choice's tokens
    choice: int = 0  # which of the n choices
    content: str | None = None  # with tools: the part of `text` that is no call (None without tools)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    # On the first chunk, when asked with `prompt_logprobs=N`: prompt token i + 1's, for each i.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", "tool_calls", "abort" or "error"
    logprobs: list[TokenLogprob]
    tool_calls: list[ToolCall]
    content: str | None  # with tools: the text that is no call (None without tools)


@dataclass(frozen=True, slots=True)
class Completion:
    """The first choice at the top; every choice in `choices`; `usage` counts the prompt once."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob]
    usage: Usage
    choices: list[Choice] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # as `Chunk.prompt_logprobs`


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    max_model_len: int


class ClientError(Exception):
    """A call failed: `code` is its grpc.StatusCode, `details` the server's (or gRPC's) message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def of(cls, error: grpc.RpcError, timeout: float | None) -> ClientError:
        code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
        details: str = error.details() or ""  # type: ignore[attr-defined]
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
            details = f"{details} (the call's timeout was {timeout:g} s)"
        return cls(code, details)


# ---- streams -------------------------------------------------------------------------------------

class Stream:
    """The chunks of one `Client.generate` call. Iterate it; `close()` it, or leave its `with`
    block, to cancel the call if it is still running."""

    def __init__(self, chunks: Iterator[Chunk], request_id: str) -> None:
        self._chunks = chunks
        self.request_id = request_id

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()  # type: ignore[attr-defined]  # a generator: its `finally` cancels the call

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncStream:
    """The chunks of one `AsyncClient.generate` call: `async for` over it; `await aclose()` it, or
    leave its `async with` block, to cancel the call if it is still running."""

    def __init__(self, chunks: AsyncIterator[Chunk], request_id: str) -> None:
        self._chunks = chunks
        self.request_id = request_id

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


# ---- clients -------------------------------------------------------------------------------------

LOOPBACK_HOSTS = ("localhost", "::1", "ip6-localhost")


class _Settings:
    """What both clients share: credentials, the default deadline and the retry policy."""

    def __init__(self, api_key: str | None, timeout: float | None, max_attempts: int) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        api_key = api_key if api_key is not None else os.environ.get(env.API_KEY) or None
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout = timeout
        self.max_attempts = max_attempts

    def warn_plaintext_key(self, target: str, credentials: grpc.ChannelCredentials | None) -> None:
        """An API key sent without TLS to another host can be read on the way: said, once per client."""
        host = target.rsplit(":", 1)[0].strip("[]") if not target.startswith("unix:") else "localhost"
        if self.metadata and credentials is None and host not in LOOPBACK_HOSTS and not host.startswith("127."):
            warnings.warn(f"pdserve client: the API key goes to {target} in plaintext; pass tls=True (or the "
                          "server's CA certificate) unless the network between is trusted", UserWarning, stacklevel=3)

    def deadline(self, timeout: float | None) -> _Deadline:
        return _Deadline(timeout if timeout is not None else self.timeout)

    def retry_delay(self, error: grpc.RpcError, attempt: int, deadline: _Deadline) -> float | None:
        """Seconds to wait before trying again after `attempt` (0-based) failed, or None: give up."""
        if error.code() != grpc.StatusCode.UNAVAILABLE or attempt + 1 >= self.max_attempts:  # type: ignore[attr-defined]
            return None
        delay = min(BACKOFF_MAX_S, BACKOFF_S * 2**attempt) * random.uniform(0.5, 1.0)  # jitter spreads a herd
        return delay if deadline.allows(delay) else None


class Client(_Settings):
    """A blocking client; thread-safe. `tls`: False (plaintext), True (the system's root
    certificates) or the PEM root certificates to trust. `api_key` defaults to $PDSERVE_API_KEY."""

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None, tls: bool | bytes = False,
                 timeout: float | None = None, max_attempts: int = MAX_ATTEMPTS) -> None:
        super().__init__(api_key, timeout, max_attempts)
        credentials = _credentials(tls)
        self.warn_plaintext_key(target, credentials)
        self.channel = grpc.insecure_channel(target, _CHANNEL_OPTIONS) if credentials is None else \
            grpc.secure_channel(target, credentials, _CHANNEL_OPTIONS)
        self.stub = pdserve_pb2_grpc.InferenceServiceStub(self.channel)

    def generate(self, prompt: Prompt, *, request_id: str | None = None, model: str | None = None,
                 timeout: float | None = None, **sampling: Any) -> Stream:
        """Stream the output as it is produced, one `Chunk` per step; the call starts on the first
        `next()`. `request_id` (default: a fresh one, also `stream.request_id`) names it for `abort`."""
        request = _request_of(prompt, sampling, request_id, model)
        return Stream(self._chunks(request, self.deadline(timeout)), request.request_id)

    def complete(self, prompt: Prompt, *, request_id: str | None = None, model: str | None = None,
                 timeout: float | None = None, **sampling: Any) -> Completion:
        """The whole output at once."""
        request = _request_of(prompt, sampling, request_id, model)
        return _completion_of(self._unary(self.stub.Complete, request, timeout))

    def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        """End a request wherever it runs (no error if it already finished)."""
        self._unary(self.stub.Abort, pb.AbortRequest(request_id=request_id), timeout)

    def list_models(self, *, timeout: float | None = None) -> list[Model]:
        response = self._unary(self.stub.ListModels, pb.ListModelsRequest(), timeout)
        return [Model(model.name, model.max_model_len) for model in response.models]

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The standard health check, once, no retry: "SERVING", "NOT_SERVING", ... `service` ""
        is the server as a whole; "pdserve.v1.InferenceService" the API alone."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=self.metadata,
                                  timeout=self.deadline(timeout).remaining())
        except grpc.RpcError as error:
            raise ClientError.of(error, timeout) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        """Close the channel, cancelling every call still running on it."""
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        deadline = self.deadline(timeout)
        for attempt in itertools.count():
            try:
                return method(request, timeout=deadline.remaining(), metadata=self.metadata)
            except grpc.RpcError as error:
                delay = self.retry_delay(error, attempt, deadline)
                if delay is None:
                    raise ClientError.of(error, deadline.timeout) from None
            time.sleep(delay)

    def _chunks(self, request: pb.GenerateRequest, deadline: _Deadline) -> Iterator[Chunk]:
        for attempt in itertools.count():
            call = self.stub.Generate(request, timeout=deadline.remaining(), metadata=self.metadata)
            received = False
            try:
                for response in call:
                    received = True
                    yield _chunk_of(response)
                return
            except grpc.RpcError as error:
                delay = None if received else self.retry_delay(error, attempt, deadline)
                if delay is None:
                    raise ClientError.of(error, deadline.timeout) from None
            finally:
                call.cancel()  # a no-op once the call ended; stops it when the caller left early
            time.sleep(delay)


class AsyncClient(_Settings):
    """The asyncio client: the same methods as `Client`, awaited; use it from one event loop."""

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None, tls: bool | bytes = False,
                 timeout: float | None = None, max_attempts: int = MAX_ATTEMPTS) -> None:
        super().__init__(api_key, timeout, max_attempts)
        credentials = _credentials(tls)
        self.warn_plaintext_key(target, credentials)
        self.channel = grpc.aio.insecure_channel(target, _CHANNEL_OPTIONS) if credentials is None else \
            grpc.aio.secure_channel(target, credentials, _CHANNEL_OPTIONS)
        self.stub = pdserve_pb2_grpc.InferenceServiceStub(self.channel)

    def generate(self, prompt: Prompt, *, request_id: str | None = None, model: str | None = None,
                 timeout: float | None = None, **sampling: Any) -> AsyncStream:
        request = _request_of(prompt, sampling, request_id, model)
        return AsyncStream(self._chunks(request, self.deadline(timeout)), request.request_id)

    async def complete(self, prompt: Prompt, *, request_id: str | None = None, model: str | None = None,
                       timeout: float | None = None, **sampling: Any) -> Completion:
        request = _request_of(prompt, sampling, request_id, model)
        return _completion_of(await self._unary(self.stub.Complete, request, timeout))

    async def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        await self._unary(self.stub.Abort, pb.AbortRequest(request_id=request_id), timeout)

    async def list_models(self, *, timeout: float | None = None) -> list[Model]:
        response = await self._unary(self.stub.ListModels, pb.ListModelsRequest(), timeout)
        return [Model(model.name, model.max_model_len) for model in response.models]

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service), metadata=self.metadata,
                                        timeout=self.deadline(timeout).remaining())
        except grpc.RpcError as error:
            raise ClientError.of(error, timeout) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self.close()

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        deadline = self.deadline(timeout)
        for attempt in itertools.count():
            try:
                return await method(request, timeout=deadline.remaining(), metadata=self.metadata)
            except grpc.RpcError as error:
                delay = self.retry_delay(error, attempt, deadline)
                if delay is None:
                    raise ClientError.of(error, deadline.timeout) from None
            await asyncio.sleep(delay)

    async def _chunks(self, request: pb.GenerateRequest, deadline: _Deadline) -> AsyncIterator[Chunk]:
        for attempt in itertools.count():
            call = self.stub.Generate(request, timeout=deadline.remaining(), metadata=self.metadata)
            received = False
            try:
                async for response in call:
                    received = True
                    yield _chunk_of(response)
                return
            except grpc.RpcError as error:
                delay = None if received else self.retry_delay(error, attempt, deadline)
                if delay is None:
                    raise ClientError.of(error, deadline.timeout) from None
            finally:
                call.cancel()
            await asyncio.sleep(delay)


# ---- helpers -------------------------------------------------------------------------------------

class _Deadline:
    """One call's deadline, shared by its attempts."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    def allows(self, delay: float) -> bool:
        """Whether an attempt after `delay` seconds still has time to run."""
        return self.end is None or time.monotonic() + delay < self.end


def _credentials(tls: bool | bytes) -> grpc.ChannelCredentials | None:
    if tls is False:
        return None
    return grpc.ssl_channel_credentials(root_certificates=None if tls is True else tls)


def _request_of(prompt: Prompt, sampling: dict[str, Any], request_id: str | None,
                model: str | None) -> pb.GenerateRequest:
    # The client names the request, so retries reuse the name and `abort` can reach it.
    sampling = dict(sampling)
    tools = {name: sampling.pop(name) for name in ("tools", "tool_choice", "parallel_tool_calls") if name in sampling}
    cache_salt = sampling.pop("cache_salt", None)  # a field of the request, not of its sampling
    request = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, model=model or "",
                                 sampling=_sampling_of(sampling), cache_salt=cache_salt)
    if tools and not (prompt and not isinstance(prompt, str) and isinstance(prompt[0], Mapping)):
        raise TypeError("tools, tool_choice and parallel_tool_calls go with a chat prompt (a list of messages)")
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and all(isinstance(message, Mapping) for message in prompt):
        chat: Sequence[Mapping[str, Any]] = prompt  # type: ignore[assignment]
        request.chat.CopyFrom(_chat_of(chat, **tools))
    else:
        request.token_ids.SetInParent()  # an empty list too: the server says the prompt is empty
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return request


def _chat_of(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
             tool_choice: str | Mapping[str, Any] | None = None, parallel_tool_calls: bool | None = None) -> pb.Chat:
    chat = pb.Chat(messages=[_message_of(message) for message in messages], tools=[_tool_of(tool) for tool in tools])
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICE_MODES:
            raise TypeError(f"tool_choice is {tool_choice!r}: use one of {TOOL_CHOICE_MODES} or "
                            "{'function': {'name': ...}}")
        chat.tool_choice.mode = tool_choice
    elif tool_choice is not None:
        chat.tool_choice.function = tool_choice.get("function", tool_choice)["name"]
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls
    return chat


def _message_of(message: Mapping[str, Any]) -> pb.ChatMessage:
    """An OpenAI-shaped message: `tool_calls` as [{"id", "function": {"name", "arguments"}}] (or flat)."""
    calls = [call.get("function", call) | {"id": call.get("id") or ""} for call in message.get("tool_calls") or ()]
    return pb.ChatMessage(role=message["role"], content=message.get("content") or "",
                          tool_call_id=message.get("tool_call_id") or "",
                          tool_calls=[pb.ToolCall(id=call["id"], name=call["name"], arguments=_json(call["arguments"]))
                                      for call in calls])


def _tool_of(tool: Mapping[str, Any]) -> pb.Tool:
    function = tool.get("function", tool)
    parameters = function.get("parameters")
    return pb.Tool(name=function["name"], description=function.get("description") or "",
                   parameters="" if parameters is None else _json(parameters), strict=function.get("strict"))


def _json(value: str | Mapping[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _sampling_of(options: dict[str, Any]) -> pb.SamplingParams:
    known = pb.SamplingParams.DESCRIPTOR.fields_by_name
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"unknown sampling options {unknown}; the options are {sorted(known)}")
    given = {name: value for name, value in options.items() if value is not None}  # None: the default
    if isinstance(given.get("stop"), str):
        given["stop"] = [given["stop"]]
    if isinstance(given.get("structured"), StructuredOutput):
        given["structured"] = _structured_message(given["structured"])
    return pb.SamplingParams(**given)


def _structured_message(structured: StructuredOutput) -> pb.StructuredOutput:
    """`structured=StructuredOutput(...)`; a dict such as {"regex": "..."} or a pb.StructuredOutput
    goes as it is."""
    if structured.kind == "json_object":
        return pb.StructuredOutput(json_object=True)
    if structured.kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(choices=structured.choices()))
    message = pb.StructuredOutput()
    setattr(message, {"json": "json_schema"}.get(structured.kind, structured.kind), structured.spec)
    return message


def _finish_reason_of(value: int) -> str | None:
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()  # type: ignore[arg-type]


def _logprobs_of(entries: Any) -> list[TokenLogprob]:
    return [TokenLogprob(entry.token_id, entry.logprob, [(top.token_id, top.logprob) for top in entry.top])
            for entry in entries]


def _usage_of(usage: pb.Usage) -> Usage:
    return Usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens, usage.cached_tokens)


def _chunk_of(response: pb.GenerateResponse) -> Chunk:
    return Chunk(response.request_id, response.index, list(response.token_ids), response.text, response.finished,
                 _finish_reason_of(response.finish_reason), _logprobs_of(response.logprobs),
                 _usage_of(response.usage) if response.HasField("usage") else None, response.choice,
                 response.content if response.HasField("content") else None,
                 [ToolCallDelta(delta.index, delta.id, delta.name, delta.arguments) for delta in response.tool_calls],
                 prompt_logprobs=_logprobs_of(response.prompt_logprobs))


def _calls_of(calls: Any) -> list[ToolCall]:
    return [ToolCall(call.id, call.name, call.arguments) for call in calls]


def _choice_of(choice: pb.CompletionChoice) -> Choice:
    return Choice(choice.index, list(choice.token_ids), choice.text, _finish_reason_of(choice.finish_reason),
                  _logprobs_of(choice.logprobs), _calls_of(choice.tool_calls),
                  choice.content if choice.HasField("content") else None)


def _completion_of(response: pb.CompleteResponse) -> Completion:
    return Completion(response.request_id, list(response.token_ids), response.text,
                      _finish_reason_of(response.finish_reason), _logprobs_of(response.logprobs),
                      _usage_of(response.usage), [_choice_of(choice) for choice in response.choices],
                      _calls_of(response.tool_calls), response.content if response.HasField("content") else None,
                      prompt_logprobs=_logprobs_of(response.prompt_logprobs))
