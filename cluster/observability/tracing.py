"""OpenTelemetry traces: one trace per request, across the gateway, the router and the workers.

A request's spans (docs/observability.md, Traces, lists each with its attributes):

    pdserve.request            gateway (HTTP or gRPC door); continues a client's W3C `traceparent`
      pdserve.route            router: the workers it picked, the prefix it expects cached
        pdserve.prefill        prefill worker (pdserve.generate on a colocated worker)
          pdserve.queue        from the request's arrival to its first scheduled chunk
          pdserve.prefill_chunk  one per engine step that computed part of the prompt
          pdserve.kv_send      one per KV frame sent (bytes, blocks, transport)
            pdserve.kv_receive   decode worker: the last frame landed -> imported into the blocks
        pdserve.decode_admission decode worker: blocks reserved -> request admitted (or recomputed)
        pdserve.decode_stream    decode worker: the stream of tokens after the first

Context crosses processes as a W3C `traceparent` string: passed with the request on Ray calls, and
in the KV frame's header (`KVHeader.traceparent`), so the receiving worker's span joins the trace.
Every process sets up its own tracer provider (`configure`) from the `TracingConfig` it is given.

Off (no endpoint), `configure` installs nothing: every hook returns at its first line, so no span
object is created and no context string is built on the hot path.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the SDK loads only where tracing is on
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # the W3C header (and gRPC metadata key) that carries a trace's context
MAX_TRACEPARENT_CHARS = 128  # a valid one has 55; longer ones in a KV header are refused
EXPORT_DELAY_MS = 500  # how long finished spans wait before a batch goes out (short: workers die abruptly)
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"  # the OpenTelemetry variable, read by `pdserve serve`


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where traces go and how many requests are traced; an empty endpoint turns tracing off."""

    endpoint: str = ""  # an OTLP/gRPC collector, e.g. http://otel-collector:4317
    sample_ratio: float = 1.0  # the share of new traces recorded (a client's sampled traceparent wins)

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str):
            raise ValueError(f"tracing.endpoint must be a string (an OTLP gRPC address), got {self.endpoint!r}")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"tracing.sample_ratio must be in [0, 1], got {self.sample_ratio}")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


class _Tracing:
    """This process's tracer and provider, None while tracing is off."""

    tracer: Tracer | None = None
    provider: TracerProvider | None = None


_tracing = _Tracing()


def configure(config: TracingConfig, service_name: str, exporter: SpanExporter | None = None) -> None:
    """Set this process's tracing up (each process once: the server, every router and worker actor).
    `exporter` replaces the OTLP one (tests hand an in-memory exporter); off without either."""
    shutdown()
    if not config.enabled and exporter is None:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    _tracing.provider, _tracing.tracer = provider, provider.get_tracer("pdserve")
    log.info("%s: traces of %.0f%% of requests go to %s", service_name, 100 * config.sample_ratio,
             config.endpoint or type(exporter).__name__)


def shutdown() -> None:
    """Send what is buffered and turn tracing off in this process."""
    provider, _tracing.provider, _tracing.tracer = _tracing.provider, None, None
    if provider is not None:
        provider.shutdown()


def flush() -> None:
    if _tracing.provider is not None:
        _tracing.provider.force_flush()


def enabled() -> bool:
    return _tracing.tracer is not None


# ---- context as a string ------------------------------------------------------------------------

def _context_of(traceparent: str) -> Context | None:
    """The context a W3C traceparent names; None for a missing or malformed one (a new root)."""
    from opentelemetry.trace import get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})
    return context if get_current_span(context).get_span_context().is_valid else None


def traceparent_of(span: Span | None) -> str:
    """The W3C traceparent naming `span`, to pass across a process boundary; "" without one."""
    if span is None or not span.is_recording():
        return ""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def _start(name: str, traceparent: str, attributes: Mapping[str, Any], start_ns: int | None = None,
           kind: Any = None) -> Span | None:
    """A span under `traceparent`'s context (a root without one); None when tracing is off or the
    trace is not sampled (so nothing downstream is built for it)."""
    if _tracing.tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    span = _tracing.tracer.start_span(name, context=_context_of(traceparent) if traceparent else None,
                                      kind=kind or SpanKind.INTERNAL, attributes=dict(attributes),
                                      start_time=start_ns)
    if not span.is_recording():
        span.end()
        return None
    return span


def _end(span: Span | None, attributes: Mapping[str, Any] | None = None, end_ns: int | None = None,
         error: BaseException | None = None) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes({key: value for key, value in attributes.items() if value is not None})
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end(end_time=end_ns)


# ---- the gateway and the router -----------------------------------------------------------------

def start_request(door: str, request_id: str, num_prompt_tokens: int,
                  headers: Mapping[str, str] | Any = None) -> Span | None:
    """The request's root span in the gateway (`door`: "http" or "grpc"), continuing the client's
    W3C traceparent when `headers` (HTTP headers, gRPC metadata pairs) carry a valid one."""
    if _tracing.tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    given = _header(headers)
    return _start("pdserve.request", given, {"pdserve.request_id": request_id, "pdserve.door": door,
                                             "pdserve.prompt_tokens": num_prompt_tokens}, kind=SpanKind.SERVER)


def _header(headers: Mapping[str, str] | Any) -> str:
    """The traceparent in HTTP headers (a mapping) or gRPC metadata ((key, value) pairs); "" if none."""
    if headers is None:
        return ""
    if isinstance(headers, Mapping) or hasattr(headers, "get"):
        value = headers.get(TRACEPARENT)
    else:
        value = next((item[1] for item in headers if item[0] == TRACEPARENT), None)
    return value if isinstance(value, str) and len(value) <= MAX_TRACEPARENT_CHARS else ""


def end_request(span: Span | None, completion_tokens: int, finish_reasons: str) -> None:
    _end(span, {"pdserve.completion_tokens": completion_tokens, "pdserve.finish_reason": finish_reasons or None})


# The traceparent of the request a gateway task serves: set around the service call, read by the
# service to pass on (tasks created meanwhile, the front doors' pumps, inherit it).
_current: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_traceparent", default="")


@contextlib.contextmanager
def current(span: Span | None) -> Iterator[None]:
    """Make `span` the request's current one while the gateway submits it to the service."""
    if span is None:
        yield
        return
    token = _current.set(traceparent_of(span))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # reset from another context (a generator driven elsewhere)
            _current.reset(token)


def current_traceparent() -> str:
    """The traceparent of the request the gateway is submitting ("" when untraced): what a service
    passes on to the router or the worker."""
    return _current.get()


@contextlib.contextmanager
def route(request_id: str, traceparent: str, mode: str) -> Iterator[Route]:
    """The router's span of one request's run: `Route.chose` records the workers and cache hit."""
    chosen = Route(_start("pdserve.route", traceparent, {"pdserve.request_id": request_id, "pdserve.mode": mode})) \
        if traceparent else UNTRACED
    error: BaseException | None = None
    try:
        yield chosen
    except BaseException as failure:
        error = failure
        raise
    finally:
        _end(chosen.span, error=error if isinstance(error, Exception) else None)


@dataclass(slots=True)
class Route:
    span: Span | None

    @property
    def traceparent(self) -> str:
        """What the router passes to the workers it calls ("" when off: the workers trace nothing)."""
        return traceparent_of(self.span)

    def chose(self, **attributes: Any) -> None:
        """Record a routing decision: `prefill_worker`, `decode_worker`, `cached_tokens`, `cache_hit`..."""
        if self.span is not None:
            self.span.set_attributes({f"pdserve.{key}": value for key, value in attributes.items()
                                      if value is not None})


UNTRACED = Route(None)  # a request without a trace: every method returns at once


# ---- the workers --------------------------------------------------------------------------------

@dataclass(slots=True)
class _RequestSpans:
    parent: str  # the router's traceparent
    num_prompt_tokens: int
    arrived_ns: int
    spans: dict[str, Span] = field(default_factory=dict)
    main: str = ""  # the span the queue and chunk spans go under, while its prompt computes
    computed: int = -1  # prompt tokens computed so far (-1: not scheduled yet)


class WorkerTraces:
    """The spans of the requests one worker runs, by request id. Empty, and free, while tracing is
    off or for requests that came without a traceparent. Its methods run on the worker's event loop,
    except `after_step`, which the engine thread calls (it only reads the dict and ends spans)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.open: dict[str, _RequestSpans] = {}

    def begin(self, request_id: str, traceparent: str, name: str, num_prompt_tokens: int = 0,
              watch_prompt: bool = False) -> None:
        """Start span `name` for the request under the router's `traceparent`. `watch_prompt`: time
        its queue wait and prompt chunks under it (`after_step`)."""
        if not traceparent or _tracing.tracer is None:
            return
        record = self.open.get(request_id)
        if record is None:
            record = self.open[request_id] = _RequestSpans(traceparent, num_prompt_tokens, time.time_ns())
        span = _start(name, record.parent, {"pdserve.request_id": request_id, "pdserve.worker_id": self.worker_id})
        if span is not None:
            record.spans[name] = span
            record.main = name if watch_prompt else record.main

    def end(self, request_id: str, name: str, **attributes: Any) -> None:
        record = self.open.get(request_id)
        if record is not None:
            _end(record.spans.pop(name, None), {f"pdserve.{key}": value for key, value in attributes.items()})

    def finish(self, request_id: str, error: BaseException | None = None) -> None:
        """End whatever spans of the request are still open (it left this worker)."""
        record = self.open.pop(request_id, None) if self.open else None
        for span in list(record.spans.values()) if record is not None else ():
            _end(span, error=error)

    def after_step(self, requests: Mapping[str, Any], step_s: float) -> None:
        """After an engine step of `step_s` seconds: a chunk span for each watched prompt that
        computed tokens in it (and its queue span at its first). `requests`: the scheduler's."""
        if not self.open:
            return
        end_ns = time.time_ns()
        start_ns = end_ns - int(step_s * 1e9)
        try:  # on the engine thread: a tracing problem must never fail the step's requests
            for request_id, record in list(self.open.items()):
                parent = record.spans.get(record.main)
                if parent is not None:
                    self._chunk(parent, record, requests.get(request_id), start_ns, end_ns)
        except Exception:
            log.exception("%s: recording prompt chunks failed (the requests go on untraced)", self.worker_id)
            self.open.clear()

    def _chunk(self, parent: Span, record: _RequestSpans, request: Any, start_ns: int, end_ns: int) -> None:
        computed = record.num_prompt_tokens if request is None else \
            min(request.num_computed_tokens, record.num_prompt_tokens)
        if computed <= max(record.computed, 0):
            return
        context = traceparent_of(parent)
        if record.computed < 0:  # its first chunk: the wait before it, and the prefix it found cached
            cached = max(getattr(request, "num_cached_tokens", 0), 0) if request is not None else 0
            _end(_start("pdserve.queue", context, {}, start_ns=record.arrived_ns), end_ns=start_ns)
            parent.set_attribute("pdserve.cached_tokens", cached)
            record.computed = cached
        chunk = _start("pdserve.prefill_chunk", context,
                       {"pdserve.first_token": record.computed, "pdserve.tokens": computed - record.computed},
                       start_ns=start_ns)
        _end(chunk, end_ns=end_ns)
        record.computed = computed
        if computed >= record.num_prompt_tokens:
            record.main = ""  # its prompt is done: no more chunks to watch

    @contextlib.contextmanager
    def kv_send(self, request_id: str, header: Any, transport: str) -> Iterator[Any]:
        """Around one KV frame's send: yields the header to send, carrying this span's context so
        that the receiver's span joins the trace (the header itself when untraced)."""
        record = self.open.get(request_id) if self.open else None
        span = record.spans.get(record.main or "pdserve.prefill") if record is not None else None
        if span is None:
            yield header
            return
        send = _start("pdserve.kv_send", traceparent_of(span),
                      {"pdserve.bytes": header.nbytes, "pdserve.blocks": header.num_blocks,
                       "pdserve.first_block": header.first_block, "pdserve.last": header.last,
                       "pdserve.transport": transport})
        started = time.perf_counter()
        try:
            yield dataclasses.replace(header, traceparent=traceparent_of(send))
        except Exception as error:
            _end(send, error=error)
            raise
        _end(send, {"pdserve.duration_s": time.perf_counter() - started})

    def kv_landed(self, request_id: str, header: Any, nbytes: int) -> None:
        """The last KV frame landed: its receive span starts, under the sender's span (the header's
        context), and ends when the KV is in the reserved blocks (`end(..., "pdserve.kv_receive")`)."""
        record = self.open.get(request_id) if self.open else None
        traceparent = getattr(header, "traceparent", "")
        if record is None or not traceparent:
            return
        span = _start("pdserve.kv_receive", traceparent, {"pdserve.request_id": request_id,
                                                          "pdserve.worker_id": self.worker_id,
                                                          "pdserve.bytes": nbytes})
        if span is not None:
            record.spans["pdserve.kv_receive"] = span
