"""The OpenAI-compatible HTTP front door: a FastAPI app over a `Service`, and a uvicorn server for it.

A request's way through:

1. Three ASGI middlewares, outermost first: `RequestIdMiddleware` names the request (`cmpl-<hex>` /
   `chatcmpl-<hex>`, always the server's own; a client's `X-Request-Id` is only echoed and logged);
   `BodyLimitMiddleware` refuses bodies over the limit (413); `ApiKeyMiddleware` checks the bearer key
   on `/v1/` routes and vLLM's `/tokenize` and `/detokenize` (401). Their errors, like every other,
   use OpenAI's error JSON.
2. FastAPI validates the body into a `cluster.serving.http.openai_protocol` model (400 on failure, not FastAPI's 422).
3. The route checks the model name (404) and that the gateway accepts requests (503 while the service
   starts or the gateway drains), builds the prompt and per-choice `SamplingParams` (400), and opens a
   `ChoiceStreams`: one engine request per choice, all submitted at once. The response starts only when every
   choice has its first token, so a full queue (429) or a refused request still gets its status code.
4. The run's events become either one JSON response or server-sent events ending in `data: [DONE]`.
   However the response ends (done, error, client gone, server stopping), `ChoiceStreams.close` aborts the engine
   requests that have not finished, so their KV blocks return to the pool within one engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.common import env
from cluster.common.errors import NoCapacityError, QueueFullError, ServiceUnavailable
from cluster.common.events import TokenEvent
from cluster.common.sampling_params import SamplingParams
from cluster.observability import tracing
from cluster.serving.api_keys import ApiKeys, Tenant
from cluster.serving.cache_domains import DEFAULT_ISOLATION, cache_domain, check_isolation
from cluster.serving.connection_limits import DEFAULT_STREAM_WRITE_TIMEOUT_S, ConnectionLimits
from cluster.serving.http.connections import bound_send_buffer, deadline_protocol
from cluster.serving.http.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatFormat,
    Choice,
    CompletionFormat,
    CompletionRequest,
    CompletionResponse,
    Echo,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseFormat,
    Usage,
)
from cluster.serving.http.tokenizing import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    tokenize,
)
from cluster.serving.merged_streams import MergedStreams
from cluster.serving.off_loop import OffLoop
from cluster.serving.rate_limits import RateLimited, RateLimits
from cluster.serving.request_limits import LimitExceeded, RequestLimits
from cluster.serving.service import MAX_REQUEST_ID_LENGTH, Service, check_structured
from cluster.serving.tools.template import ToolServing, parser_for

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
RETRY_AFTER_S = 1
# How long a streamed response's write may wait for a client that does not read before the client is
# disconnected and its request aborted (what the socket holds first is bounded: `send_buffer_bytes`).
EVENTS_AHEAD = 16  # per API request: events taken from the service streams but not yet sent
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left: logged, never received
TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # vLLM's, at the root; behind the API key as /v1/ is
RATE_LIMITED_PATHS = ("/v1/completions", "/v1/chat/completions", *TOKENIZER_PATHS)
QUIET_PATHS = ("/health", "/ready", "/metrics")  # probed every few seconds: logged at DEBUG only
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)}
# With "stream": true the answer is server-sent events. The schema describes one event (OpenAPI 3.1):
# its data is a chunk's JSON (or an error's, after a failure), then the last one's is "[DONE]".
EVENT_STREAM = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk's JSON, or [DONE] at the end"}}}}}


# ---- errors ----------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered with OpenAI's error JSON and `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        detail = ErrorDetail(message=self.message, type=ERROR_TYPES.get(self.status, "server_error"),
                             param=self.param, code=self.code)
        return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=self.status, headers=self.headers)


@contextmanager
def service_errors(request_id: str) -> Iterator[None]:
    """Map what a service (and prompt building) raises to the status a client should see."""
    try:
        yield
    except ApiError:
        raise
    except LimitExceeded as error:
        raise ApiError(400, str(error), code="request_limit_exceeded") from error
    except (ValueError, jinja2.TemplateError) as error:
        raise ApiError(400, str(error)) from error
    except (QueueFullError, NoCapacityError) as error:
        raise ApiError(429, str(error), code="rate_limit_exceeded",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from error
    except RateLimited as error:
        raise ApiError(429, str(error), code="rate_limit_exceeded",
                       headers={"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}) from error
    except ServiceUnavailable as error:
        raise ApiError(503, str(error), headers={"Retry-After": str(RETRY_AFTER_S)}) from error
    except Exception as error:
        log.exception("%s: request failed", request_id)
        raise ApiError(500, f"internal error: {type(error).__name__}") from error


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return error.response()


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    return ApiError(error.status_code, str(error.detail), headers=dict(error.headers or {})).response()


async def _validation_error(request: Request, error: Exception) -> Response:
    """FastAPI answers 422; OpenAI's API (and its clients) expect 400 for an invalid body."""
    assert isinstance(error, RequestValidationError)
    problems = error.errors()
    param = _field_of(problems[0]) if problems else None
    return ApiError(400, "; ".join(_describe(problem) for problem in problems), param=param).response()


def _field_of(problem: Any) -> str | None:
    """The field a validation problem is about ("messages.0.role"); None for the body as a whole."""
    if problem["type"] == "json_invalid":
        return None  # its location is a character offset, not a field
    return ".".join(str(part) for part in problem["loc"] if part != "body") or None


def _describe(problem: Any) -> str:
    if problem["type"] == "json_invalid":
        reason = problem.get("ctx", {}).get("error", "")
        return f"the body is not valid JSON: {reason} at character {problem['loc'][-1]}"
    message = str(problem["msg"]).removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    field = _field_of(problem)
    return f"{field}: {message}" if field else message


# ---- the engine requests behind one API request ----------------------------------------------------


class ChoiceStreams:
    """The `n` choices of one API request, each an engine request (`<id>`, or `<id>-<i>` when n > 1),
    merged into one stream of (choice, event) in arrival order (`cluster.serving.merged_streams`, at
    most `EVENTS_AHEAD` events ahead of the client), each event added to its choice as it passes.
    """

    def __init__(self, service: Service, request_id: str, prompt: list[int], params: list[SamplingParams],
                 runs: set[ChoiceStreams]) -> None:
        self.service, self.request_id, self.prompt, self.params, self.runs = service, request_id, prompt, params, runs
        self.request_ids = [request_id] if len(params) == 1 else [f"{request_id}-{i}" for i in range(len(params))]
        self.choices = [Choice(index) for index in range(len(params))]
        self.merged: MergedStreams | None = None
        self.buffer: list[tuple[Choice, TokenEvent]] = []  # the first events, taken by `open`
        self.closed = False
        self.span: Any = None  # the request's trace span (`cluster.observability.tracing`), when traced
        runs.add(self)

    async def open(self) -> None:
        """Submit every choice and wait for each one's first event; raises what the service raises."""
        self.merged = MergedStreams([self.service.generate(self.prompt, params, request_id)
                                     for params, request_id in zip(self.params, self.request_ids, strict=True)],
                                    EVENTS_AHEAD)
        started: set[int] = set()
        while len(started) < len(self.choices) and (item := await self._next()) is not None:
            self.buffer.append(item)
            started.add(item[0].index)

    async def events(self) -> AsyncIterator[tuple[Choice, TokenEvent]]:
        """Each event after it was added to its choice, until every choice finished."""
        while self.buffer:
            yield self.buffer.pop(0)
        while (item := await self._next()) is not None:
            yield item

    async def finish(self) -> None:
        async for _ in self.events():
            pass

    def usage(self) -> Usage:
        # The prompt counts once however many choices share it: so do its cached tokens (the first choice's).
        return Usage.of(len(self.prompt), sum(choice.num_tokens for choice in self.choices),
                        self.choices[0].num_cached_tokens)

    async def close(self) -> None:
        """Stop the pumps and abort the choices that did not finish. Runs to the end even when the
        caller is being cancelled (a client that left): that is when the abort matters most."""
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            if self.merged is not None:
                await self.merged.aclose()
            for choice, request_id in zip(self.choices, self.request_ids, strict=True):
                if not choice.finished:
                    await self.service.abort(request_id)
        self.runs.discard(self)
        reasons = ",".join(choice.finish_reason or "aborted" for choice in self.choices)
        completion = self.usage().completion_tokens
        tracing.end_request(self.span, completion, reasons)
        log.info("%s: %d prompt + %d completion tokens, finish %s", self.request_id, len(self.prompt), completion,
                 reasons, extra={"request_id": self.request_id, "prompt_tokens": len(self.prompt),
                                 "completion_tokens": completion, "finish_reason": reasons})

    def events_held(self) -> int:
        """Events taken from the service streams and not yet sent (at most `EVENTS_AHEAD`, plus endings)."""
        return self.merged.queue.qsize() if self.merged is not None else 0

    async def _next(self) -> tuple[Choice, TokenEvent] | None:
        assert self.merged is not None, "open the run first"
        try:
            index, event = await anext(self.merged)
        except StopAsyncIteration:
            return None
        self.choices[index].add(event)
        return self.choices[index], event


class EventStream(StreamingResponse):
    """Server-sent events of a run, which is closed however the response ends.

    A client that stops reading is cut off: once the socket's bounded send buffer is full, a write
    that has waited `write_timeout_s` ends the response unfinished (uvicorn then closes the
    connection) and the run is aborted on every worker.
    """

    def __init__(self, run: ChoiceStreams, response_format: ResponseFormat, include_usage: bool,
                 write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S) -> None:
        super().__init__(_sse(run, response_format, include_usage), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.run, self.write_timeout_s = run, write_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            try:
                async with asyncio.timeout(self.write_timeout_s):  # a timer, not a task per chunk
                    await send(message)
            except TimeoutError:
                raise _SlowReader from None

        # Starlette cancels the body on a client disconnect; the abort must still happen.
        try:
            await super().__call__(scope, receive, send_in_time)
        except _SlowReader:
            completion = self.run.usage().completion_tokens
            log.warning("%s: the client read nothing for %.0f s: disconnected after %d tokens, aborting",
                        self.run.request_id, self.write_timeout_s, completion,
                        extra={"request_id": self.run.request_id})
        finally:
            await self.run.close()


class _SlowReader(Exception):
    """A write to the client did not complete in time."""


async def _sse(run: ChoiceStreams, response_format: ResponseFormat, include_usage: bool) -> AsyncIterator[str]:
    for opening in response_format.opening(len(run.choices)):
        yield _event(opening.model_dump_json())
    try:
        async for choice, event in run.events():
            for chunk in response_format.chunks(choice, event):
                yield _event(chunk.model_dump_json())
        if include_usage:
            yield _event(response_format.usage_chunk(run.usage()).model_dump_json())
    except Exception as error:  # the status line is gone: report in-band, as vLLM does
        yield _event(ErrorResponse(error=_stream_error(run.request_id, error)).model_dump_json())
    yield _event("[DONE]")


def _stream_error(request_id: str, error: Exception) -> ErrorDetail:
    """What a stream that failed after its status line says, in-band: the status a client would have
    had (503: retry later; 429: the cluster is full) and why, never a bare "internal error" for a
    failure the client can act on."""
    try:
        with service_errors(request_id):
            raise error
    except ApiError as api_error:  # an unexpected error was logged with its traceback there
        return ErrorDetail(message=api_error.message, type=ERROR_TYPES.get(api_error.status, "server_error"),
                           code=api_error.code or str(api_error.status))
    raise AssertionError("service_errors maps every error")  # pragma: no cover


def _event(data: str) -> str:
    return f"data: {data}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Run `work`; False if the client hung up first (then `work` is cancelled). Starlette does not
    cancel a handler whose client left, so a request waiting in a queue would otherwise live on."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return False
    task.result()  # raises the work's error
    return True


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# ---- the gateway -----------------------------------------------------------------------------------


class Gateway:
    """What the routes share: the service, the limits, the pool that keeps tokenizing and formatting
    off the event loop, the format of the model's tool calls, whose requests share prefix-cache
    blocks (`cache_domains`), and whether new requests are accepted (`draining`)."""

    def __init__(self, service: Service, limits: RateLimits | None = None,  # noqa: PLR0913
                 request_limits: RequestLimits | None = None, off_loop: OffLoop | None = None,
                 stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S,
                 tools: ToolServing | None = None, prefix_cache_isolation: str = DEFAULT_ISOLATION) -> None:
        self.service = service
        tools = tools or ToolServing()
        self.exclude_tools_when_tool_choice_none = tools.exclude_tools_when_tool_choice_none
        self.tool_parser = parser_for(service.tokenizer, tools.parser, service.model_name)
        self.prefix_cache_isolation = check_isolation(prefix_cache_isolation)
        self.stream_write_timeout_s = stream_write_timeout_s
        self.limits = limits
        self.request_limits = request_limits or RequestLimits()
        self.off_loop = off_loop or OffLoop()
        self.draining = False
        # Whether /ready says why the service is not ready (a worker's error text: hosts, devices,
        # exceptions). Off where an operator port answers that instead (`route_operator_endpoints`).
        self.ready_reasons = True
        self.runs: set[ChoiceStreams] = set()

    @property
    def ready(self) -> bool:
        return self.service.ready and not self.draining

    def readiness(self, reasons: bool) -> JSONResponse:
        """/ready's answer: 200 when ready, else 503, with the service's problem if `reasons`."""
        if self.ready:
            return JSONResponse({"status": "ready"})
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        body = {"status": "not ready"}
        if reasons and self.service.problem:  # e.g. a worker whose warm-up failed: what an operator must fix
            body["reason"] = self.service.problem
        return JSONResponse(body, status_code=503)

    def start_draining(self) -> None:
        """Refuse new requests (503) and report not ready, so a load balancer moves traffic away;
        requests already running finish."""
        self.draining = True

    async def drain(self, timeout_s: float = 30.0) -> bool:
        """Start draining, then wait until the running requests finish; False on timeout."""
        self.start_draining()
        deadline = time.monotonic() + timeout_s
        while self.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.runs


    def shown_tools(self, body: ChatCompletionRequest) -> ChatCompletionRequest:
        """`body` with the tools its prompt shows: none under tool_choice none when the server
        excludes them then (vLLM's `--exclude-tools-when-tool-choice-none`), else all it offers."""
        if self.exclude_tools_when_tool_choice_none and body.tool_choice == "none":
            return body.model_copy(update={"tools": None})
        return body

    def in_cache_domain(self, params: list[SamplingParams], tenant: Tenant | None,
                        cache_salt: str | None) -> list[SamplingParams]:
        """Each choice's params with the request's cache domain: its prompt shares prefix-cache blocks
        only with requests of that domain, and `cached_tokens` counts only those."""
        domain = cache_domain(self.prefix_cache_isolation, tenant, cache_salt)
        return [dataclasses.replace(choice, cache_domain=domain) for choice in params]

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.service.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.service.model_name!r}", param="model", code="model_not_found")

    def admit(self, model: str | None) -> None:
        """Whether a generation request may start: 404 for another model, 503 unless ready."""
        self.check_model(model)
        if not self.ready:
            reason = "the server is draining" if self.draining else "the model is not ready"
            raise ApiError(503, f"{reason}; retry later", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def respond(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                      response_format: ResponseFormat) -> Response:
        """Run the request and answer it: JSON, or an event stream (which closes the run itself)."""
        request_id = request.state.request_id
        with service_errors(request_id):
            body.check_limits(self.request_limits)  # before any work: a 4 MB prompt is not tokenized
            # Its requests bucket was taken before its body was read (`RateLimitMiddleware`).
            tenant = getattr(request.state, "tenant", None)
            limits = self.limits.for_tenant(tenant) if self.limits is not None else None
            bucket = _bucket_of(request, tenant)
            prompt = await self.off_loop.run(body.prompt_ids, self.service.tokenizer, tenant=bucket)
            response_format.start(prompt)
            params = self.in_cache_domain(body.sampling_params(len(prompt), self.service.max_model_len), tenant,
                                          body.cache_salt)
            if limits is not None:
                await limits.check_tokens(bucket, len(prompt) + sum(p.max_tokens for p in params))
            # Compiled (and cached) for admitted requests only; the same grammar for all choices.
            await self.off_loop.run(check_structured, self.service.tokenizer, params[0], tenant=bucket)
        run = ChoiceStreams(self.service, request_id, prompt, params, self.runs)
        run.span = tracing.start_request("http", request_id, len(prompt), request.headers)
        streaming = False
        try:
            with service_errors(request_id), tracing.current(run.span):
                if not await _unless_disconnected(request, run.open()):
                    return _client_left(run)
                if body.stream:
                    streaming = True
                    return EventStream(run, response_format, body.include_usage, self.stream_write_timeout_s)
                if not await _unless_disconnected(request, run.finish()):
                    return _client_left(run)
            # n choices with logprobs make a large answer: formatted off the loop too.
            answer = await self.off_loop.run(lambda: response_format.response(run.choices, run.usage())
                                             .model_dump_json(), tenant=bucket)
            return Response(answer, media_type="application/json")
        finally:
            if not streaming:
                await run.close()


def _client_left(run: ChoiceStreams) -> Response:
    log.info("%s: the client went away; aborting", run.request_id)
    return Response(status_code=CLIENT_CLOSED_REQUEST)


def gateway_of(app: FastAPI) -> Gateway:
    gateway = app.state.gateway
    assert isinstance(gateway, Gateway)
    return gateway


def _echo_of(body: CompletionRequest) -> Echo | None:
    try:
        return body.echo_of()
    except ValueError as error:  # a batch of prompts: refused as without echo, not a 500
        raise ApiError(400, str(error), param="prompt") from error


def _add_routes(app: FastAPI, gateway: Gateway) -> None:
    service = gateway.service

    @app.get("/health", summary="The process is alive")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="The model is loaded and the server takes requests")
    async def ready() -> JSONResponse:
        return gateway.readiness(gateway.ready_reasons)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=service.model_name, max_model_len=service.max_model_len)])

    @app.get("/v1/models/{model}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def model(model: str) -> ModelCard:
        gateway.check_model(model)
        return ModelCard(id=service.model_name, max_model_len=service.max_model_len)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={
        **ERROR_RESPONSES, 200: {"content": EVENT_STREAM, "description": "a completion, or its chunks as events"}})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        gateway.admit(body.model)
        response_format = CompletionFormat(request.state.public_id, service.model_name, service.tokenizer,
                                           logprobs=body.logprobs is not None, echo=_echo_of(body))
        return await gateway.respond(request, body, response_format)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={
        **ERROR_RESPONSES, 200: {"content": EVENT_STREAM, "description": "a chat completion, or its chunks as events"}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        gateway.admit(body.model)
        body = gateway.shown_tools(body)
        response_format = ChatFormat(request.state.public_id, service.model_name, service.tokenizer,
                                     logprobs=body.logprobs, tools=body.chosen_tools(), parser=gateway.tool_parser)
        return await gateway.respond(request, body, response_format)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize_route(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        gateway.admit(body.model)
        with service_errors(request.state.request_id):
            bucket = _bucket_of(request, getattr(request.state, "tenant", None))  # counted by RateLimitMiddleware
            return await gateway.off_loop.run(tokenize, body, service.tokenizer, gateway.request_limits,
                                              service.max_model_len, tenant=bucket)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize_route(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        gateway.admit(body.model)
        with service_errors(request.state.request_id):
            bucket = _bucket_of(request, getattr(request.state, "tenant", None))  # counted by RateLimitMiddleware
            return DetokenizeResponse(prompt=await gateway.off_loop.run(body.text, service.tokenizer, tenant=bucket))


# ---- middlewares (plain ASGI: they must not buffer streamed responses) -----------------------------


class RequestIdMiddleware:
    """Names each request with an id of the server's own (`cmpl-<hex>`, `chatcmpl-<hex>`): the engine
    request id, in `request.state.request_id`. A client's `X-Request-Id` is never an engine id (two
    clients could otherwise pick the same one and end each other's requests): it is only echoed (in
    the response header and the body's `id`, `request.state.public_id`) and logged next to ours. One
    over MAX_REQUEST_ID_LENGTH characters or with unprintable ones is a 400."""

    PREFIXES = {"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl"}

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = f"{self.PREFIXES.get(scope['path'], 'req')}-{uuid.uuid4().hex}"
        given = _header(scope, b"x-request-id")
        public_id = given or request_id
        state = scope.setdefault("state", {})
        state["request_id"], state["public_id"] = request_id, public_id
        started, status = time.perf_counter(), 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", public_id.encode())]
            await send(message)

        try:
            if given is not None and (len(given) > MAX_REQUEST_ID_LENGTH or not given.isprintable()):
                public_id = request_id  # not echoed: it is what was refused
                error = ApiError(400, f"X-Request-Id must be at most {MAX_REQUEST_ID_LENGTH} printable characters",
                                 param="X-Request-Id", code="invalid_request_id")
                return await error.response()(scope, receive, send_with_id)
            await self.app(scope, receive, send_with_id)
        finally:
            level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
            duration = time.perf_counter() - started
            client_id = f" (client's id {given!r})" if given and public_id == given else ""
            log.log(level, "%s%s: %s %s -> %d in %.3fs", request_id, client_id, scope["method"], scope["path"], status,
                    duration, extra={"request_id": request_id, "client_request_id": given if client_id else None,
                                     "method": scope["method"], "path": scope["path"], "status": status,
                                     "duration_s": round(duration, 6)})


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: by its Content-Length at once, else while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large().response()(scope, receive, send)
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # FastAPI re-raises an HTTPException from body reading; the handler makes it JSON.
                raise HTTPException(413, self._too_large().message)
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")


class RateLimitMiddleware:
    """429 for a generation or tokenizer request over its caller's requests per second, before its
    body is read: a client over its limit costs the server no parsing, tokenizing or compiling. Its
    tokens (prompt + max_tokens) are taken once it is tokenized (`Gateway.respond`)."""

    def __init__(self, app: ASGIApp, limits: RateLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in RATE_LIMITED_PATHS:
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        tenant = state.get("tenant")
        try:
            with service_errors(state.get("request_id", "")):
                await self.limits.for_tenant(tenant).check_request(_bucket(scope.get("client"), tenant))
        except ApiError as error:
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """401 for `/v1/` (and tokenizer) requests without `Authorization: Bearer <key>` of a known key; health checks
    stay open. The key's tenant goes to `request.state.tenant` (its rate limits, its scope)."""

    def __init__(self, app: ASGIApp, api_keys: ApiKeys) -> None:
        self.app, self.api_keys = app, api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in TOKENIZER_PATHS):
            return await self.app(scope, receive, send)
        tenant = self.api_keys.tenant_of(_header(scope, b"authorization"))
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
            return await self.app(scope, receive, send)
        error = ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


def _bucket_of(request: Request, tenant: Tenant | None) -> str:
    return _bucket(request.scope.get("client"), tenant)


def _bucket(client: tuple[str, int] | None, tenant: Tenant | None) -> str:
    """Whom the rate limits count against: the key's tenant, else the client's address (as the
    trusted proxies forward it). Never a bearer the server does not know: a client could send a
    fresh one with each request."""
    if tenant is not None:
        return "tenant:" + tenant.name
    return "addr:" + (client[0] if client else "unknown")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def build_app(  # noqa: PLR0913
        service: Service, *, api_key: str | ApiKeys | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              limits: RateLimits | None = None, request_limits: RequestLimits | None = None,
              off_loop: OffLoop | None = None, stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S,
              tool_call_parser: str = "auto", exclude_tools_when_tool_choice_none: bool = False,
              prefix_cache_isolation: str = DEFAULT_ISOLATION) -> FastAPI:
    """The gateway app. `api_key`: one key, or the `ApiKeys` of several tenants (None reads
    `$PDSERVE_API_KEY`); no key at all leaves the API open. `tool_call_parser`: the format of the
    model's tool calls (`cluster.serving.tools.parsers`; "auto": from its chat template);
    `exclude_tools_when_tool_choice_none`: vLLM's flag, tools left out of the prompt under tool_choice none;
    `prefix_cache_isolation`: whether API keys share prefix-cache blocks (`cache_domains`). The
    `Gateway` (draining) is `gateway_of(app)`."""
    api_keys = api_key if isinstance(api_key, ApiKeys) else \
        ApiKeys.of(api_key if api_key is not None else os.environ.get(env.API_KEY) or None)
    app = FastAPI(title="pdserve", summary="OpenAI-compatible API of a pdserve cluster", version="1")
    gateway = Gateway(service, limits, request_limits, off_loop, stream_write_timeout_s,
                      ToolServing(tool_call_parser, exclude_tools_when_tool_choice_none), prefix_cache_isolation)
    app.state.gateway = gateway
    _add_routes(app, gateway)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    _document_400_not_422(app)
    # add_middleware wraps: the last added runs first.
    if limits is not None:  # inside the keys' check: it counts against the key's tenant
        app.add_middleware(RateLimitMiddleware, limits=limits)
    if api_keys.enabled:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    app.add_middleware(RequestIdMiddleware)
    return app


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents a 422 for every body it validates; this gateway answers 400 instead (each
    operation documents it), so the OpenAPI document drops the 422 and its schemas."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()  # FastAPI keeps it in app.openapi_schema: edited in place, once
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


class HttpServer:
    """uvicorn serving an app as a task of the running event loop, beside other servers (gRPC,
    metrics). `port=0` binds a free port; `port` then tells which. uvicorn's logging setup and access
    log are off: the host configures logging, and `RequestIdMiddleware` logs each request.

    Binding happens in `start`, here, so a port in use raises OSError to the caller instead of
    uvicorn's `sys.exit`. In the main thread uvicorn takes SIGINT/SIGTERM while it runs, shuts down
    gracefully, then re-raises the signal.
    """

    def __init__(self, app: ASGIApp, host: str = "0.0.0.0", port: int = 8000, *,
                 graceful_shutdown_s: float = 10.0, trusted_proxies: str = "",
                 tls: tuple[str, str] | None = None, connections: ConnectionLimits | None = None,
                 name: str = "HTTP gateway") -> None:
        self.app, self.host, self.requested_port, self.tls, self.name = app, host, port, tls, name
        self.connections = connections = connections or ConnectionLimits()
        # X-Forwarded-For / -Proto are believed only from `trusted_proxies` (addresses and networks,
        # comma-separated, e.g. the Ingress pods' CIDR): from anyone else a client could name any
        # address, and so any rate-limit bucket. Empty (the default): from nobody, not even 127.0.0.1.
        self.config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                     timeout_graceful_shutdown=max(1, round(graceful_shutdown_s)),
                                     proxy_headers=bool(trusted_proxies), forwarded_allow_ips=trusted_proxies or None,
                                     # HTTPS where `tls` names a PEM certificate (chain) file and its key file.
                                     ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None,
                                     # Past `max_connections` open connections (or requests in
                                     # flight) every new request is answered 503 at once.
                                     limit_concurrency=connections.max_connections,
                                     # Each request must arrive whole within the deadline (slowloris);
                                     # an idle keep-alive connection closes after 5 s (uvicorn's).
                                     http=deadline_protocol(connections.request_read_timeout_s))
        self.server = uvicorn.Server(self.config)
        self.socket: socket.socket | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        assert self.socket is not None, "start() the server first"
        return int(self.socket.getsockname()[1])

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the server."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        scheme = "https" if self.tls else "http"
        return f"{scheme}://[{host}]:{self.port}" if ":" in host else f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve; returns once connections are accepted."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self.socket = socket.create_server((self.host, self.requested_port), family=family)
        bound_send_buffer(self.socket, self.connections.send_buffer_bytes)
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]), name="http-server")
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info("%s listening on %s", self.name, self.url)

    async def wait(self) -> None:
        """Until the server stops (`stop`, or a signal)."""
        assert self.task is not None, "start() the server first"
        await asyncio.shield(self.task)

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (up to the graceful timeout), then return."""
        if self.task is None:
            return
        self.server.should_exit = True
        await self.task


async def serve_http(app: ASGIApp, host: str = "0.0.0.0", port: int = 8000) -> None:
    """Serve until stopped (a signal, or cancelling this coroutine)."""
    server = HttpServer(app, host, port)
    await server.start()
    try:
        await server.wait()
    finally:
        await server.stop()
