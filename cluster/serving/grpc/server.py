"""The gRPC front door: `pdserve.v1.InferenceService` over a `Service`, with health and reflection.

An RPC's life: the API-key interceptor admits it (the health service stays open: probes send no
metadata); the servicer turns the request into prompt ids and `SamplingParams`, then relays the
service's `TokenEvent`s as `GenerateResponse`s, or gathers them for `Complete`. However a running
request's RPC ends early (client cancel, exceeded deadline, client gone, server stopping), the
handler's `finally` aborts it in the service, so its KV blocks go back within one engine step.
An `Abort` call aborts the request in the service and, when its call runs on this server, ends
that call with a last "abort" message (the service's event stream would not end by itself).

Errors become status codes: ValueError INVALID_ARGUMENT, QueueFullError and NoCapacityError
RESOURCE_EXHAUSTED, ServiceUnavailable UNAVAILABLE, a model this server does not serve NOT_FOUND,
anything else INTERNAL (logged). A request whose bytes do not parse (corrupt, or a string field that
is not UTF-8) is INVALID_ARGUMENT too, before any handler runs (`MalformedRequestInterceptor`).

Health: "" and "pdserve.v1.InferenceService" read SERVING while `service.ready` and NOT_SERVING
otherwise (polled), and NOT_SERVING for good once `drain()` (or `stop()`) was called.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import jinja2
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster.common import env
from cluster.common.errors import NoCapacityError, QueueFullError, ServiceUnavailable
from cluster.common.events import TokenEvent, TokenLogprobs
from cluster.common.sampling_params import SamplingParams
from cluster.common.structured_output import StructuredOutput
from cluster.grpc_stubs import pdserve_pb2 as pb
from cluster.grpc_stubs import pdserve_pb2_grpc
from cluster.observability import tracing
from cluster.serving.api_keys import ApiKeys, Tenant
from cluster.serving.cache_domains import DEFAULT_ISOLATION, cache_domain, check_cache_salt, check_isolation
from cluster.serving.connection_limits import DEFAULT_STREAM_WRITE_TIMEOUT_S, ConnectionLimits
from cluster.serving.grpc.chat import chat_prompt, tool_choice_of
from cluster.serving.grpc.choices import CallReader, ChoiceEvents, completion_of, merged
from cluster.serving.off_loop import OffLoop
from cluster.serving.rate_limits import RateLimited, RateLimits
from cluster.serving.request_limits import MAX_CHOICES, RequestLimits, utf8_length
from cluster.serving.service import MAX_REQUEST_ID_LENGTH, Service, check_structured
from cluster.serving.tools.choice import ToolChoice
from cluster.serving.tools.template import ToolServing, parser_for

__all__ = ["SERVICE_NAME", "GrpcServer"]

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
HEALTH_POLL_S = 0.5

# Server-sent keepalive pings: a client that vanished without closing its connection (a dead host,
# a dropped network) has its calls cancelled, and its requests' blocks freed, within about a minute.


def _server_options(max_connections: int, handshake_timeout_s: float) -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # A second server on a taken port must fail to start, not silently share the port's traffic.
        ("grpc.so_reuseport", 0),
        # Connections past the limit are refused; one that has not finished its handshake (TLS and
        # HTTP/2 settings) in time is closed; one idle for 5 minutes gets a GOAWAY; at most 1,024
        # calls at once per connection.
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", round(handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", 300_000),
        ("grpc.max_concurrent_streams", 1024),
    ]

_FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                   "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "logprobs", "prompt_logprobs")
_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class ModelNotFound(LookupError):
    """The request names a model this server does not serve (NOT_FOUND)."""


class _InUse(ValueError):
    """A client's request id already names one of its calls in flight (ALREADY_EXISTS)."""


# Errors raised before a request runs: it holds nothing, so there is nothing to abort. First match wins.
_REFUSALS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (_InUse, grpc.StatusCode.ALREADY_EXISTS),  # before ValueError: it is one
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (jinja2.TemplateError, grpc.StatusCode.INVALID_ARGUMENT),  # a chat the template rejects
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RateLimited, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoCapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ServiceUnavailable, grpc.StatusCode.UNAVAILABLE),
)
_REFUSAL_TYPES = tuple(error_type for error_type, _ in _REFUSALS)


class GrpcServer:
    """Serves `service` over gRPC from the running event loop (next to an HTTP server, say).

    `api_key`, one key or the `ApiKeys` of several tenants (default: $PDSERVE_API_KEY; none: no
    check), must come as `authorization: Bearer <key>` metadata; `limits` are the tenants' rate limits, as on HTTP.
    `tls` is (certificate chain, private key), both PEM. `port` 0 picks a free port; `port` holds the
    bound one after `start()`. `tools` is how chats with tools are served (the model's call format,
    whether tool_choice none shows the tools), as on HTTP. `prefix_cache_isolation`: whether API keys
    share prefix-cache blocks (`cluster.serving.cache_domains`), as on HTTP.
    """

    def __init__(self, service: Service, host: str = "0.0.0.0", port: int = 50051, *,  # noqa: PLR0913
                 api_key: str | ApiKeys | None = None, tls: tuple[bytes, bytes] | None = None,
                 limits: RateLimits | None = None, request_limits: RequestLimits | None = None,
                 off_loop: OffLoop | None = None, connections: ConnectionLimits | None = None,
                 tools: ToolServing | None = None, prefix_cache_isolation: str = DEFAULT_ISOLATION) -> None:
        self.service = service
        self.prefix_cache_isolation = check_isolation(prefix_cache_isolation)
        self.tools = tools or ToolServing()
        self.connections = connections or ConnectionLimits()
        self.api_keys = api_key if isinstance(api_key, ApiKeys) else \
            ApiKeys.of(api_key if api_key is not None else os.environ.get(env.API_KEY) or None)
        self.limits = limits
        self.request_limits = request_limits or RequestLimits()
        self.off_loop = off_loop or OffLoop()
        self.host = host
        self.port = port
        self.tls = tls
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # The key check comes first: a caller without the key learns nothing, not even that its bytes are bad.
        interceptors = [ApiKeyInterceptor(self.api_keys)] if self.api_keys.enabled else []
        interceptors.append(MalformedRequestInterceptor())
        server = grpc.aio.server(interceptors=interceptors,
                                 options=_server_options(self.connections.max_connections,
                                                         self.connections.request_read_timeout_s))
        servicer = InferenceServicer(self.service, api_keys=self.api_keys, limits=self.limits,
                                     request_limits=self.request_limits, off_loop=self.off_loop,
                                     stream_write_timeout_s=self.connections.stream_write_timeout_s,
                                     tools=self.tools, prefix_cache_isolation=self.prefix_cache_isolation)
        pdserve_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
        self.health = health.aio.HealthServicer()  # a fresh one: a drained one ignores updates for good
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.port = self._bind(server)
        await server.start()
        self.server = server
        await self._update_health()
        self._health_task = asyncio.create_task(self._poll_health())
        log.info("gRPC server listening on %s:%d", self.host, self.port)

    def _bind(self, server: grpc.aio.Server) -> int:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        address = f"{host}:{self.port}"
        if self.tls is None:
            port = server.add_insecure_port(address)
        else:
            chain, key = self.tls
            port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, chain)]))
        if port == 0:
            raise OSError(f"the gRPC server could not listen on {address}")
        return port

    async def drain(self) -> None:
        """Report NOT_SERVING from now on, so load balancers send new calls elsewhere; calls still
        in flight go on."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float | None = 5.0) -> None:
        """Drain, refuse new calls, give calls in flight `grace` seconds, then cancel them (each
        cancelled call aborts its request). Safe to call twice."""
        await self.drain()
        if self._health_task is not None:
            self._health_task.cancel()
            self._health_task = None
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None

    async def _poll_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self._update_health()

    async def _update_health(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self.service.ready else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


@dataclass(slots=True)
class _Call:
    """One Generate (or Complete) call on this server: what its end must clean up, and what it
    reports when an Abort call ends it."""

    request_id: str  # the client's (echoed in every response), else the engine's
    engine_id: str  # the service's request id: the server's own, never the client's
    task: asyncio.Task[Any] | None  # the task serving the call, which an Abort cancels
    running: bool = False  # the service may hold blocks for the request: abort it if the call ends early
    aborted: bool = False  # ended by an Abort call: finish with an "abort" message, not an error
    waiting: bool = False  # awaiting the service's next event: where an Abort may cancel the task
    num_prompt_tokens: int = 0
    # Per choice: its engine request (`engine_id`, or `<engine_id>-<i>` when n > 1), and what it did.
    engine_ids: list[str] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    # The most any event reported: the engine that computed the prompt (a prefill worker, in
    # disaggregated mode) found them; the decode worker's later events report none.
    num_cached_tokens: list[int] = field(default_factory=list)
    span: Any = None  # the request's trace span (`cluster.observability.tracing`), when traced

    def start(self, num_choices: int, num_prompt_tokens: int) -> None:
        self.engine_ids = [self.engine_id] if num_choices == 1 else \
            [f"{self.engine_id}-{index}" for index in range(num_choices)]
        self.finished, self.num_output_tokens = [False] * num_choices, [0] * num_choices
        self.num_cached_tokens = [0] * num_choices
        self.running, self.num_prompt_tokens = True, num_prompt_tokens

    def record(self, choice: int, event: TokenEvent) -> None:
        self.finished[choice] = event.finished
        self.running = not all(self.finished)
        self.num_prompt_tokens = event.num_prompt_tokens
        self.num_output_tokens[choice] = event.index + len(event.token_ids)
        self.num_cached_tokens[choice] = max(self.num_cached_tokens[choice], event.num_cached_tokens)

    def unfinished(self) -> list[str]:
        """The engine requests that may still hold blocks."""
        return [engine_id for engine_id, done in zip(self.engine_ids, self.finished, strict=True) if not done]

    def usage(self, choice: int) -> pb.Usage:
        completion = self.num_output_tokens[choice] if self.num_output_tokens else 0
        cached = self.num_cached_tokens[choice] if self.num_cached_tokens else 0
        return pb.Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                        total_tokens=self.num_prompt_tokens + completion, cached_tokens=cached)

    def cut_off(self, write_timeout_s: float) -> None:
        """The client read nothing for `write_timeout_s`: end the call (the request is aborted)."""
        log.warning("request %s (%s): the client read nothing for %.0f s: cancelling the call after %d tokens",
                    self.engine_id, self.request_id, write_timeout_s, sum(self.num_output_tokens))
        if self.task is not None:
            self.task.cancel()

    def aborted_responses(self) -> list[pb.GenerateResponse]:
        """A last "abort" message for each choice not finished (the first, before any started)."""
        choices = [index for index, done in enumerate(self.finished) if not done] if self.engine_ids else [0]
        return [pb.GenerateResponse(request_id=self.request_id, choice=index, finished=True,
                                    index=self.num_output_tokens[index] if self.num_output_tokens else 0,
                                    finish_reason=pb.FINISH_REASON_ABORT, usage=self.usage(index))
                for index in choices]


class InferenceServicer(pdserve_pb2_grpc.InferenceServiceServicer):
    """The gRPC API over a `Service`. Request ids are scoped: the engine id of a call is the server's
    own, and a client's `request_id` names its call only among calls of the same tenant (the API key's;
    without keys, the bearer sent, or one scope for callers without one). So an Abort ends only a
    request of the tenant that sent it, never another client's, nor an HTTP request."""

    def __init__(self, service: Service, *, api_keys: ApiKeys | None = None,  # noqa: PLR0913
                 limits: RateLimits | None = None, request_limits: RequestLimits | None = None,
                 off_loop: OffLoop | None = None, stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S,
                 tools: ToolServing | None = None, prefix_cache_isolation: str = DEFAULT_ISOLATION) -> None:
        self.service = service
        self.prefix_cache_isolation = check_isolation(prefix_cache_isolation)
        self.stream_write_timeout_s = stream_write_timeout_s
        self.tools = tools or ToolServing()
        self.tool_parser = parser_for(service.tokenizer, self.tools.parser, service.model_name)
        self.api_keys = api_keys or ApiKeys()
        self.limits = limits
        self.request_limits = request_limits or RequestLimits()
        self.off_loop = off_loop or OffLoop()
        # The calls in flight here, by (scope, client's request id). An Abort ends the matching call
        # itself: the service frees the request's blocks, but its event stream would not end on its own.
        self.calls: dict[tuple[str, str], _Call] = {}

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        engine_id = f"grpc-{uuid.uuid4().hex}"
        call = _Call(request.request_id or engine_id, engine_id, asyncio.current_task())
        tenant = self._tenant_of(context)
        key = (self._scope_of(context, tenant), call.request_id)
        try:
            _check_request_id(request.request_id)
            if key in self.calls:
                raise _InUse(f"request_id {call.request_id!r} is already in flight for this API key")
            self.calls[key] = call
            prompt, params, tools = await self._prepare(request, context, tenant)
            if call.aborted:  # an Abort came while the prompt was being prepared
                yield call.aborted_responses()[0]  # no choice started: one message, the first choice's
                return
            call.start(len(params), len(prompt))
            events = merged([self.service.generate(prompt, choice_params, choice_id)
                             for choice_params, choice_id in zip(params, call.engine_ids, strict=True)])
            reader = CallReader(tools, self.tool_parser)
            call.span = tracing.start_request("grpc", engine_id, len(prompt), context.invocation_metadata())
            with tracing.current(call.span):
                async with contextlib.aclosing(events):
                    async for response in _responses(call, events, self.stream_write_timeout_s, reader):
                        yield response
        except asyncio.CancelledError:
            if not call.aborted:
                raise  # the client cancelled, its deadline passed, or the server is stopping
            call.task.uncancel()  # type: ignore[union-attr]  # the cancel was this server's own
            for response in call.aborted_responses():
                yield response
        except _REFUSAL_TYPES as error:
            call.running = False
            await _refuse(context, error)
        except Exception:
            log.exception("request %s (%s) failed", engine_id, call.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"request {call.request_id} failed on the server")
        finally:
            tracing.end_request(call.span, sum(call.num_output_tokens), "abort" if call.aborted or call.running else "")
            if self.calls.get(key) is call:
                del self.calls[key]
            if call.running:
                # Shielded: the call's own cancellation must not cancel the abort that frees the blocks.
                await asyncio.shield(self._abort(call))

    async def _abort(self, call: _Call) -> None:
        for engine_id in call.unfinished() or [call.engine_id]:
            await self.service.abort(engine_id)

    async def _prepare(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       tenant: Tenant | None) -> tuple[list[int], list[SamplingParams], ToolChoice | None]:
        """The request checked (model, limits, rate limits), its prompt's token ids, each choice's
        sampling and the tools its chat offers; raises a refusal."""
        if request.model and request.model != self.service.model_name:
            raise ModelNotFound(f"this server serves {self.service.model_name!r}, not {request.model!r}")
        n = _n_of(request.sampling)
        tools = tool_choice_of(request.chat) if request.WhichOneof("prompt") == "chat" else None
        domain = cache_domain(self.prefix_cache_isolation, tenant, _cache_salt_of(request))
        params = dataclasses.replace(_with_tools(_params_of(request.sampling), tools), cache_domain=domain)
        self._check_limits(request, params, n)  # before any work: a 4 MB prompt is not tokenized
        # Rate limits before any work too: a tenant over its limit costs the shared pool nothing.
        limits = self.limits.for_tenant(tenant) if self.limits is not None else None
        bucket = _bucket_of(context, tenant)
        if limits is not None:
            await limits.check_request(bucket)
        prompt = await self.off_loop.run(self._prompt_of, request, tenant=bucket)
        _check_min_tokens(len(prompt), params, self.service.max_model_len)
        if limits is not None:
            await limits.check_tokens(bucket, len(prompt) + n * params.max_tokens)
        await self.off_loop.run(check_structured, self.service.tokenizer, params, tenant=bucket)  # admitted only
        return prompt, _choice_params(params, n), tools

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        responses = [response async for response in self.Generate(request, context)]
        completion = completion_of(responses, max(response.choice for response in responses) + 1)
        completion.prompt_logprobs.extend(entry for r in responses for entry in r.prompt_logprobs)
        return completion

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """End the caller's own request of that id (sent with the same API key); any other id is a no-op."""
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        call = self.calls.get((self._scope_of(context, self._tenant_of(context)), request.request_id))
        if call is None:
            return pb.AbortResponse()
        call.aborted = True
        # Cancel the call's task only where it awaits the service's next event: cancelled while gRPC
        # sends a response, the cancel lands in gRPC's own code and the stream can hang until its
        # deadline. Elsewhere the call sees `aborted` at its next step.
        if call.waiting and call.task is not None:
            call.task.cancel()
        await self._abort(call)
        return pb.AbortResponse()

    def _tenant_of(self, context: grpc.aio.ServicerContext) -> Tenant | None:
        return self.api_keys.tenant_of(_authorization(context)) if self.api_keys.enabled else None

    @staticmethod
    def _scope_of(context: grpc.aio.ServicerContext, tenant: Tenant | None) -> str:
        """Whose request ids a call names: its tenant's; without keys, the bearer it sent (hashed),
        else one shared scope for callers without one."""
        if tenant is not None:
            return "tenant:" + tenant.name
        bearer = _authorization(context)
        return hashlib.sha256(bearer.encode()).hexdigest() if bearer else ""

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        model = pb.Model(name=self.service.model_name, max_model_len=self.service.max_model_len)
        return pb.ListModelsResponse(models=[model])

    def _check_limits(self, request: pb.GenerateRequest, params: SamplingParams, n: int) -> None:
        # A chat's bytes: everything its template renders, the tools' names, descriptions and schemas too.
        texts = [request.text] if request.WhichOneof("prompt") == "text" else \
            [message.content for message in request.chat.messages] + \
            [text for tool in request.chat.tools for text in (tool.name, tool.description, tool.parameters)]
        self.request_limits.check_prompt(sum(utf8_length(text) for text in texts), len(request.chat.messages))
        self.request_limits.check_sampling(params.stop, params.stop_token_ids, n, params.logprobs)
        self.request_limits.check_grammar(params.structured.spec if params.structured is not None else "")

    def _prompt_of(self, request: pb.GenerateRequest) -> list[int]:
        tokenizer = self.service.tokenizer
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return tokenizer.encode(request.text)
        if kind == "chat":
            return chat_prompt(tokenizer, request.chat, self.tools.exclude_tools_when_tool_choice_none)
        if kind == "token_ids":
            return list(request.token_ids.ids)  # the engine checks them against its vocabulary
        raise ValueError("the request has no prompt: set text, token_ids or chat")


def _params_of(message: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep SamplingParams' defaults (proto3 would read them as 0)."""
    given = {name: getattr(message, name) for name in _OPTIONAL_PARAMS if message.HasField(name)}
    # A double field can carry NaN or an infinity, which no sampling value means (and some ranges admit).
    if not_finite := [name for name in _FLOAT_PARAMS if name in given and not math.isfinite(given[name])]:
        raise ValueError(f"{', '.join(not_finite)} must be a finite number")
    structured = _structured_of(message.structured) if message.HasField("structured") else None
    return SamplingParams(**given, stop=tuple(message.stop), stop_token_ids=tuple(message.stop_token_ids),
                          ignore_eos=message.ignore_eos, min_tokens=message.min_tokens, priority=message.priority,
                          logit_bias=tuple(sorted(message.logit_bias.items())),
                          include_stop_str_in_output=message.include_stop_str_in_output, structured=structured)


def _cache_salt_of(request: pb.GenerateRequest) -> str | None:
    """The request's cache_salt; unset is none, empty or too long a ValueError (INVALID_ARGUMENT)."""
    return check_cache_salt(request.cache_salt) if request.HasField("cache_salt") else None


def _n_of(message: pb.SamplingParams) -> int:
    n = message.n if message.HasField("n") else 1
    if not 1 <= n <= MAX_CHOICES:
        raise ValueError(f"n is {n}: it must be from 1 to {MAX_CHOICES}")
    return n


def _choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One `SamplingParams` per choice; with a seed, choice i samples with `seed + i` (as the HTTP
    door): the same seed for all would make the n choices identical."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=params.seed + index) for index in range(n)]


def _with_tools(params: SamplingParams, tools: ToolChoice | None) -> SamplingParams:
    """Under tool_choice required or a named function, the output is held to calls by their schema."""
    structured = tools.structured_output() if tools is not None else None
    if structured is None:
        return params
    if params.structured is not None:
        raise ValueError("chat.tool_choice (required or a function) and sampling.structured both constrain the "
                         "answer: send one of them")
    return dataclasses.replace(params, structured=structured)


def _structured_of(message: pb.StructuredOutput) -> StructuredOutput:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured is set but names no kind: set json_schema, json_object, regex, choice or grammar")
    if kind == "json_object":
        if not message.json_object:
            raise ValueError("structured.json_object must be true (leave structured unset for free text)")
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput.of_choices(list(message.choice.choices))
    return StructuredOutput({"json_schema": "json"}.get(kind, kind), getattr(message, kind))


def _check_min_tokens(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    """A max_tokens past the context's end ends the request there ("length"), but a min_tokens past
    it cannot be honoured: the engine would neither stop before it nor find room to go on, and the
    request would wait for ever."""
    room = max_model_len - num_prompt_tokens
    if params.min_tokens > room:
        raise ValueError(f"min_tokens is {params.min_tokens}, but the prompt has {num_prompt_tokens} tokens and "
                         f"the context is {max_model_len}: at most {room} tokens can be generated")


def _authorization(context: grpc.aio.ServicerContext) -> str:
    return str(dict(context.invocation_metadata() or ()).get("authorization", ""))


def _bucket_of(context: grpc.aio.ServicerContext, tenant: Tenant | None) -> str:
    """Whom the rate limits count against: the key's tenant, else the peer's address (as on HTTP)."""
    if tenant is not None:
        return "tenant:" + tenant.name
    peer = context.peer() or "unknown"  # "ipv4:10.0.0.7:51234", "ipv6:[::1]:51234"
    return "addr:" + peer.partition(":")[2].rpartition(":")[0].strip("[]")


def _check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LENGTH or not request_id.isprintable():
        raise ValueError(f"request_id must be at most {MAX_REQUEST_ID_LENGTH} printable characters")


async def _responses(call: _Call, events: ChoiceEvents, write_timeout_s: float,
                     reader: CallReader) -> AsyncIterator[pb.GenerateResponse]:
    """The call's responses, one per event. `call.waiting` marks where an Abort may cancel the task
    (awaiting the next event); an Abort that comes while a response is being sent ends the stream
    at the next step instead.

    gRPC holds the call at its `yield` while it sends the response, and HTTP/2 flow control holds
    the send while the client does not read: held `write_timeout_s`, the call is cancelled (its
    request aborted on every worker) instead of the engine generating for nobody."""
    loop = asyncio.get_running_loop()
    while True:
        call.waiting = True
        try:
            choice, event = await anext(events)
        except StopAsyncIteration:
            return
        finally:
            call.waiting = False
        call.record(choice, event)
        response = _response_of(call, choice, event)
        reader.annotate(choice, response)
        unsent = loop.call_later(write_timeout_s, call.cut_off, write_timeout_s)
        try:
            yield response
        finally:
            unsent.cancel()
        if call.aborted and call.running:
            for aborted in call.aborted_responses():
                yield aborted
            return


def _response_of(call: _Call, choice: int, event: TokenEvent) -> pb.GenerateResponse:
    finish_reason = _FINISH_REASONS.get(str(event.finish_reason), pb.FINISH_REASON_UNSPECIFIED)
    response = pb.GenerateResponse(
        request_id=call.request_id, choice=choice, index=event.index, token_ids=event.token_ids, text=event.text,
        finished=event.finished, finish_reason=finish_reason, logprobs=[_logprobs_of(lp) for lp in event.logprobs],
        prompt_logprobs=[_logprobs_of(lp) for lp in event.prompt_logprobs or [] if lp is not None])
    if event.finished:
        response.usage.CopyFrom(call.usage(choice))
    return response


def _logprobs_of(entry: TokenLogprobs) -> pb.TokenLogprobs:
    top = [pb.TopLogprob(token_id=token, logprob=logprob) for token, logprob in entry.top]
    return pb.TokenLogprobs(token_id=entry.token_id, logprob=entry.logprob, top=top)


async def _refuse(context: grpc.aio.ServicerContext, error: Exception) -> None:
    if isinstance(error, RateLimited):
        context.set_trailing_metadata((("retry-after", str(max(1, math.ceil(error.retry_after_s)))),))
    await context.abort(_status_of(error), str(error))


def _status_of(error: Exception) -> grpc.StatusCode:
    return next(code for error_type, code in _REFUSALS if isinstance(error, error_type))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Admits calls whose `authorization` metadata is `Bearer <key>` of a known key; others end
    UNAUTHENTICATED. The health service is exempt: load balancers and Kubernetes probes send no metadata."""

    def __init__(self, api_keys: ApiKeys) -> None:
        self.api_keys = api_keys

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(f"/{health.SERVICE_NAME}/"):
            return handler
        metadata = dict(details.invocation_metadata or ())  # type: ignore[attr-defined]
        if self.api_keys.tenant_of(metadata.get("authorization")) is not None:  # constant time per key
            return handler
        return _refusing(handler)


async def _unauthenticated(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong API key: send the metadata 'authorization: Bearer <key>'")


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call to the InferenceService whose request does not parse INVALID_ARGUMENT. grpc parses
    before any handler runs and, when that fails, answers UNKNOWN and logs a traceback: the client's
    mistake would read as the server's. Here a request that does not parse becomes `_Malformed`, and
    the handler, wrapped, refuses it."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/") or handler.request_streaming:
            return handler
        make = _HANDLER_KINDS[(False, handler.response_streaming)]
        behavior = _refusing_malformed_stream(handler.unary_stream) if handler.response_streaming \
            else _refusing_malformed(handler.unary_unary)
        return make(behavior, request_deserializer=_lenient(handler.request_deserializer),
                    response_serializer=handler.response_serializer)


@dataclass(frozen=True, slots=True)
class _Malformed:
    """A request whose bytes did not parse, and why."""

    reason: str

    async def refuse(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not parse: {self.reason}")


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as error:
            return _Malformed(str(error))
    return parse_or_mark


def _refusing_malformed(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await request.refuse(context)
        return await behavior(request, context)
    return unary


def _refusing_malformed_stream(behavior: Callable[..., AsyncGenerator[Any]]) -> Callable[..., AsyncGenerator[Any]]:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any]:
        if isinstance(request, _Malformed):
            await request.refuse(context)
        # aclosing: however the call ends, the handler's own cleanup (aborting its request) runs now.
        async with contextlib.aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response
    return stream


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED."""
    make = _HANDLER_KINDS[(handler.request_streaming, handler.response_streaming)]
    return make(_unauthenticated, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
