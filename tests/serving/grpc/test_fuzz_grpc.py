"""The gRPC API fuzzed: random Generate and Complete requests, most of them invalid (negative, NaN,
infinite and huge numbers, empty and out-of-vocabulary prompts, empty stop strings, unknown models,
odd chats), and random bytes that may not even parse, against a live server and a real engine.

Each call must succeed or end with the status its documented meaning gives (INVALID_ARGUMENT for a
bad request, NOT_FOUND for another model, RESOURCE_EXHAUSTED for a full queue), never INTERNAL or
UNKNOWN, and within its deadline. Afterwards the engine must have logged no error and hold nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cluster.engine.config import EngineConfig
from cluster.grpc_stubs import pdserve_pb2 as pb
from cluster.grpc_stubs import pdserve_pb2_grpc
from cluster.serving.grpc.server import SERVICE_NAME, GrpcServer
from cluster.serving.local_service import LocalService
from tests.helpers import nothing_logged_and_idle
from tests.serving.grpc.conftest import ServerLoop, pool_is_whole

EXAMPLES = 300
RAW_EXAMPLES = 200
DEADLINE_S = 10.0  # far above what a capped request needs, even on a busy machine: reaching it means a hang
MAX_TOKENS = 4  # generation is the costly part: a few tokens per request
# The statuses a request can earn by its content: INTERNAL, UNKNOWN or DEADLINE_EXCEEDED are bugs.
CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
DOUBLES = st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-310, 1e308])
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
TEXT = st.text(max_size=40)  # protobuf strings are UTF-8: no lone surrogates (the raw bytes cover those)


def mostly(plausible: st.SearchStrategy[Any], wild: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A value in the field's range three times in four, so that requests with several fields set
    still reach the engine often; anything its wire type holds otherwise."""
    return st.one_of(plausible, plausible, plausible, wild)


SAMPLING_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": mostly(st.integers(1, MAX_TOKENS), INT32),
    "temperature": mostly(st.floats(0, 2), DOUBLES),
    "top_p": mostly(st.floats(0, 1, exclude_min=True), DOUBLES),
    "top_k": mostly(st.integers(-1, 400), INT32),
    "min_p": mostly(st.floats(0, 1), DOUBLES),
    "repetition_penalty": mostly(st.floats(0, 2, exclude_min=True), DOUBLES),
    "presence_penalty": mostly(st.floats(-2, 2), DOUBLES),
    "frequency_penalty": mostly(st.floats(-2, 2), DOUBLES),
    "seed": INT64,
    "stop": st.lists(TEXT, max_size=4),
    "stop_token_ids": st.lists(mostly(st.integers(0, 400), INT32), max_size=4),
    "ignore_eos": st.booleans(),
    "min_tokens": mostly(st.integers(0, 2), INT32),
    "logprobs": mostly(st.integers(0, 20), INT32),
}


@pytest.fixture(scope="module")
def service(server_loop: ServerLoop, tiny_config: Callable[..., EngineConfig]) -> Iterator[LocalService]:
    """The engine behind this module's server: a 64-token context, so that a request running to the
    context's end (max_tokens past it is allowed, and ends there) stays cheap, and prompts reach it."""
    service = server_loop.start_service(tiny_config(num_blocks=16))
    yield service
    server_loop.run(service.stop())


@pytest.fixture(scope="module")
def stub(server: GrpcServer) -> Iterator[Any]:
    """The generated stub, not the SDK: it sends any message as it is, and retries nothing."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pdserve_pb2_grpc.InferenceServiceStub(channel)


@pytest.fixture
def left_clean(service: LocalService, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """After the test: no error logged by the server or the engine, nothing running, the pool whole."""
    with nothing_logged_and_idle(caplog, lambda: not service.engine.has_unfinished_requests()
                                 and pool_is_whole(service)):
        yield


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))


# ---- requests --------------------------------------------------------------------------------------


def prompts(vocab_size: int) -> st.SearchStrategy[dict[str, Any]]:
    """The prompt oneof: text, token ids, a chat, or none at all; usable three times in four, else
    empty, out of the vocabulary, in roles no template knows, or missing."""
    usable = st.one_of(
        st.builds(lambda text: {"text": text}, st.text(min_size=1, max_size=40)),
        st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)},
                  st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=12)),
        st.builds(lambda chat: {"chat": pb.Chat(messages=chat)},
                  st.lists(chat_messages(st.sampled_from(["system", "user", "assistant"])), min_size=1, max_size=3)))
    wild = st.one_of(
        st.builds(lambda text: {"text": text}, TEXT),
        st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}, st.lists(INT32, max_size=12)),
        st.builds(lambda chat: {"chat": pb.Chat(messages=chat)}, st.lists(chat_messages(TEXT), max_size=3)),
        st.just({}))
    return mostly(usable, wild)


def chat_messages(roles: st.SearchStrategy[str]) -> st.SearchStrategy[pb.ChatMessage]:
    return st.builds(pb.ChatMessage, role=roles, content=TEXT)


def cheap(fields: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """Cap a valid max_tokens to a few; values no request may have are kept, to be refused."""
    if MAX_TOKENS < fields.get("max_tokens", 0) <= max_model_len:
        fields["max_tokens"] = MAX_TOKENS
    return fields


@st.composite
def generate_requests(draw: st.DrawFn, service: LocalService) -> pb.GenerateRequest:
    names = draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), unique=True, max_size=5))
    fields = cheap({name: draw(SAMPLING_FIELDS[name]) for name in names}, service.max_model_len)
    model = draw(st.sampled_from(["", "", service.model_name, "another-model"]))
    request_id = draw(st.just("") | TEXT)  # calls run one at a time: a reused id is no clash
    return pb.GenerateRequest(**draw(prompts(service.engine.arch.vocab_size)), sampling=pb.SamplingParams(**fields),
                              model=model, request_id=request_id)


def call(stub: Any, method: str, request: pb.GenerateRequest) -> Any:
    """The last message of a Generate stream, or Complete's answer."""
    if method == "Generate":
        return list(stub.Generate(request, timeout=DEADLINE_S))[-1]
    return stub.Complete(request, timeout=DEADLINE_S)


def assert_answered_or_refused(answer: Any, expected: grpc.StatusCode | None) -> None:
    """Either the call's answer is a finished one, or it raised a client error: `expected`, if given."""
    if isinstance(answer, grpc.RpcError):
        assert answer.code() in CLIENT_ERRORS, f"{answer.code()}: {answer.details()}"
        assert answer.code() == (expected or answer.code()), f"{answer.code()}: {answer.details()}"
        assert answer.details()
    else:
        assert expected is None, f"answered, but should have been refused with {expected}"
        assert answer.finish_reason != pb.FINISH_REASON_UNSPECIFIED


def certain_refusal(request: pb.GenerateRequest, model_name: str) -> grpc.StatusCode | None:
    """The status a request earns whatever else it holds: INVALID_ARGUMENT for a request id over 128
    characters or with unprintable ones, NOT_FOUND for another model, then INVALID_ARGUMENT for no
    prompt, a chat without messages, or a sampling value not a finite number."""
    if len(request.request_id) > 128 or not request.request_id.isprintable():
        return grpc.StatusCode.INVALID_ARGUMENT
    if request.model not in ("", model_name):
        return grpc.StatusCode.NOT_FOUND
    sampling = request.sampling
    not_finite = any(sampling.HasField(name) and not math.isfinite(getattr(sampling, name)) for name in FLOAT_FIELDS)
    kind = request.WhichOneof("prompt")
    if not_finite or kind is None or (kind == "chat" and not request.chat.messages):
        return grpc.StatusCode.INVALID_ARGUMENT
    return None


def outcome(make_call: Callable[[], Any]) -> Any:
    """What the call returned, or the error it raised."""
    try:
        return make_call()
    except grpc.RpcError as error:
        return error


# ---- the fuzz --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("left_clean")
def test_any_request_is_answered_or_refused_with_its_documented_status(stub: Any, service: LocalService) -> None:

    @fuzz_settings(EXAMPLES)
    @given(method=st.sampled_from(["Generate", "Complete"]), request=generate_requests(service))
    # Once a hang: min_tokens past the context's end (the engine could neither stop nor go on).
    @example(method="Generate", request=pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[32, 1]), sampling=pb.SamplingParams(max_tokens=431, min_tokens=431)))
    # Once answered as if valid: an infinite temperature (sampling then ignores the logits), a chat
    # with no messages (the model answered a bare generation prompt).
    @example(method="Complete", request=pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=math.inf)))
    @example(method="Generate", request=pb.GenerateRequest(chat=pb.Chat()))
    def answered_or_refused(method: str, request: pb.GenerateRequest) -> None:
        answer = outcome(lambda: call(stub, method, request))
        assert_answered_or_refused(answer, certain_refusal(request, service.model_name))

    answered_or_refused()


@pytest.mark.usefixtures("left_clean")
def test_bytes_that_may_not_parse_are_answered_or_refused(server: GrpcServer) -> None:
    """Random bytes as a request: most do not parse (a string that is not UTF-8, a wrong wire type, a
    cut-off field); some parse by chance into a valid request, and get answered."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        def unchanged(raw: bytes) -> bytes:
            return raw

        generate = channel.unary_stream(f"/{SERVICE_NAME}/Generate", request_serializer=unchanged,
                                        response_deserializer=unchanged)
        unary = {name: channel.unary_unary(f"/{SERVICE_NAME}/{name}", request_serializer=unchanged,
                                           response_deserializer=unchanged) for name in ("Complete", "Abort")}

        def send(method: str, raw: bytes) -> Any:
            if method == "Generate":
                return list(generate(raw, timeout=DEADLINE_S))
            return unary[method](raw, timeout=DEADLINE_S)

        @fuzz_settings(RAW_EXAMPLES)
        @given(method=st.sampled_from(["Generate", "Complete", "Abort"]), raw=st.binary(max_size=64))
        # Once UNKNOWN: a text prompt (field 1) that is not UTF-8, bytes that are no protobuf at all.
        @example(method="Complete", raw=b"\x0a\x01\xff")
        @example(method="Generate", raw=b"\xff\xff\xff")
        def answered_or_refused(method: str, raw: bytes) -> None:
            answer = outcome(lambda: send(method, raw))
            if isinstance(answer, grpc.RpcError):
                assert answer.code() in CLIENT_ERRORS, f"{answer.code()}: {answer.details()}"

        answered_or_refused()
