"""`n` choices and tool calling on the gRPC door, against the HTTP door's answers to the same requests.

Where a test needs the model to call a tool, the service's answer is scripted (the HTTP tool tests'
`ScriptedService`: a random model never writes a call); the server, the SDK and everything between
them are real, and unscripted requests run the tiny model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import httpx
import jsonschema
import pytest

from cluster.client import Chunk, Client, ClientError
from cluster.common.events import TokenEvent
from cluster.common.structured_output import StructuredOutput
from cluster.engine.config import CacheConfig, EngineConfig, ModelConfig
from cluster.grpc_stubs import pdserve_pb2 as pb
from cluster.serving.grpc.server import GrpcServer, _Call
from cluster.serving.http.gateway import build_app
from cluster.serving.http.openai_protocol import ChatCompletionRequest
from cluster.serving.local_service import LocalService
from cluster.serving.tools.template import ToolServing
from tests.serving.grpc.conftest import WAIT_S, ServerLoop, pool_is_whole, wait_until
from tests.serving.http.test_tool_calling import (
    ASK,
    CALLED,
    HERMES_ANSWER,
    PARIS,
    TOOLS,
    WEATHER_TOOL,
    ScriptedService,
    build_hermes_checkpoint,
)

PROMPT = "Hello world! How are you doing today?"
# Short answers: a random model held to a schema writes what it allows, but free strings run long.
TRIP = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
TRIP_TOOL = {"type": "function", "function": {"name": "plan_trip", "parameters": TRIP}}


def http_post(server_loop: ServerLoop, service: Any, path: str, body: dict[str, Any],
              **options: Any) -> dict[str, Any]:
    """The HTTP door's answer, in process, over the same service."""
    async def post() -> dict[str, Any]:
        app = build_app(service, api_key="", **options)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gateway") as client:
            response = await client.post(path, json=body, timeout=WAIT_S)
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]
    return server_loop.run(post())


# ---- n ---------------------------------------------------------------------------------------------


def test_n_choices_are_sampled_each_on_its_own(client: Client) -> None:
    completion = client.complete(PROMPT, n=3, max_tokens=8, temperature=1.0, ignore_eos=True)
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    assert all(len(choice.token_ids) == 8 and choice.finish_reason == "length" for choice in completion.choices)
    assert len({tuple(choice.token_ids) for choice in completion.choices}) == 3  # unseeded: each its own sample
    first = completion.choices[0]
    assert (completion.token_ids, completion.text) == (first.token_ids, first.text)
    assert completion.usage.completion_tokens == 24  # the prompt counts once
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 24

    with client.generate(PROMPT, n=3, max_tokens=8, temperature=1.0, ignore_eos=True) as stream:
        chunks = list(stream)
    for index in range(3):
        mine = [chunk for chunk in chunks if chunk.choice == index]
        assert sum(len(chunk.token_ids) for chunk in mine) == 8
        assert [chunk.finished for chunk in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].usage is not None and mine[-1].usage.completion_tokens == 8


def test_a_seeded_n_gives_the_choices_https_gives(client: Client, server_loop: ServerLoop,
                                                  service: LocalService) -> None:
    options = dict(n=3, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    completion = client.complete(PROMPT, **options)  # type: ignore[arg-type]
    http = http_post(server_loop, service, "/v1/completions", {"prompt": PROMPT, **options})
    assert [choice.text for choice in completion.choices] == [choice["text"] for choice in http["choices"]]
    assert len({choice.text for choice in completion.choices}) == 3  # seed + i: not the same seed thrice
    assert client.complete(PROMPT, **options).choices == completion.choices  # type: ignore[arg-type]


class AbortsSeen:
    """A real service that notes the engine requests it is asked to run and to abort."""

    def __init__(self, service: LocalService) -> None:
        self.service = service
        self.started: list[str] = []
        self.aborted: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.service, name)

    def generate(self, prompt: list[int], params: Any, request_id: str) -> Any:
        self.started.append(request_id)
        return self.service.generate(prompt, params, request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await self.service.abort(request_id)


def test_an_abort_or_a_client_that_leaves_ends_every_choice(server_loop: ServerLoop, service: LocalService) -> None:
    seen = AbortsSeen(service)
    server = server_loop.start_server(seen)  # type: ignore[arg-type]
    try:
        with Client(f"127.0.0.1:{server.port}", timeout=WAIT_S * 3) as client:
            stream = client.generate(PROMPT, n=3, max_tokens=200, temperature=1.0, ignore_eos=True)
            next(stream)
            client.abort(stream.request_id)
            endings = {chunk.choice: chunk.finish_reason for chunk in stream if chunk.finished}
            assert endings == {0: "abort", 1: "abort", 2: "abort"}
            assert len(seen.started) == 3 and set(seen.aborted) >= set(seen.started)  # every choice's request
            assert wait_until(lambda: pool_is_whole(service))
            seen.started[:], seen.aborted[:] = [], []
            with client.generate(PROMPT, n=3, max_tokens=200, temperature=1.0, ignore_eos=True) as leaving:
                next(leaving)
            assert wait_until(lambda: set(seen.aborted) >= set(seen.started) and len(seen.started) == 3)
            assert wait_until(lambda: pool_is_whole(service))
    finally:
        server_loop.run(server.stop(0))


@pytest.mark.parametrize(("options", "message"), [
    ({"n": 0}, "n is 0: it must be from 1 to 16"), ({"n": -1}, "n is -1"), ({"n": 17}, "n is 17"),
    ({"n": 16, "logprobs": 20}, "16 choices with 20 top logprobs"),  # the request limits count every choice
])
def test_n_out_of_bounds_is_invalid_argument(client: Client, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ClientError) as error:
        client.complete(PROMPT, max_tokens=2, **options)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details


def test_cached_tokens_are_the_most_any_event_of_the_choice_reported() -> None:
    """In disaggregated mode the prefill worker's first event knows the cached prompt tokens and the
    decode worker's last one does not: the usage must not take the last one's 0."""
    call = _Call("request", "engine", None)
    call.start(1, 40)
    call.record(0, TokenEvent("engine", 0, [5], "a", False, None, 40, "prefill-0", 32))
    call.record(0, TokenEvent("engine", 1, [6], "b", True, "length", 40, "decode-0", 0))
    assert call.usage(0).cached_tokens == 32 and call.usage(0).completion_tokens == 2


# ---- tools ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted_service(server_loop: ServerLoop, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedService]:
    checkpoint = build_hermes_checkpoint(tmp_path_factory.mktemp("hermes") / "tiny-hermes")
    config = EngineConfig(model=ModelConfig(model=str(checkpoint)), cache=CacheConfig(block_size=16, num_blocks=128))
    service = ScriptedService(server_loop.start_service(config))
    yield service
    server_loop.run(service.service.stop())


@pytest.fixture
def scripted(scripted_service: ScriptedService) -> Iterator[ScriptedService]:
    yield scripted_service
    scripted_service.script, scripted_service.prompts[:], scripted_service.params[:] = None, [], []


@pytest.fixture(scope="module")
def tool_server(server_loop: ServerLoop, scripted_service: ScriptedService) -> Iterator[Callable[..., Client]]:
    """A client of a server over the scripted service, one server per `ToolServing`."""
    servers: dict[ToolServing, tuple[GrpcServer, Client]] = {}

    def client_of(tools: ToolServing | None = None) -> Client:
        tools = tools or ToolServing()
        if tools not in servers:
            server = server_loop.start_server(scripted_service, tools=tools)  # type: ignore[arg-type]
            servers[tools] = server, Client(f"127.0.0.1:{server.port}", timeout=WAIT_S * 3)
        return servers[tools][1]

    yield client_of
    for server, client in servers.values():
        client.close()
        server_loop.run(server.stop(0))


def test_a_named_tool_choice_holds_the_model_to_arguments_its_schema_admits(
        tool_server: Callable[..., Client], scripted: ScriptedService) -> None:
    completion = tool_server().complete(ASK, tools=[WEATHER_TOOL, TRIP_TOOL], max_tokens=300, temperature=1.0,
                                        seed=3, tool_choice={"function": {"name": "plan_trip"}})
    assert scripted.params[-1].structured == StructuredOutput("json", json.dumps(TRIP))
    assert completion.finish_reason == "tool_calls" and completion.content == ""
    (call,) = completion.tool_calls
    assert call.name == "plan_trip" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), TRIP)  # the model itself, held by the grammar


def reassembled(chunks: list[Chunk]) -> list[tuple[str, str]]:
    """The calls a client puts together from a stream's deltas."""
    calls: list[list[str]] = []
    for delta in (delta for chunk in chunks for delta in chunk.tool_calls):
        if delta.id:
            assert (delta.index, delta.arguments) == (len(calls), "")  # a call opens with its id and name
            calls.append([delta.name, ""])
        calls[delta.index][1] += delta.arguments
    return [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize(("answer", "options", "expected"), [
    (HERMES_ANSWER + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', {},
     [("get_weather", json.loads(PARIS)), ("get_time", {})]),
    (PARIS, {"tool_choice": {"function": {"name": "get_weather"}}}, [("get_weather", json.loads(PARIS))]),
])
def test_streamed_call_deltas_reassemble_to_the_whole_answers_calls(
        tool_server: Callable[..., Client], scripted: ScriptedService, answer: str, options: dict[str, Any],
        expected: list[tuple[str, Any]]) -> None:
    scripted.answer(answer)
    client = tool_server()
    completion = client.complete(ASK, tools=TOOLS, **options)
    assert completion.finish_reason == "tool_calls"
    assert [(call.name, json.loads(call.arguments)) for call in completion.tool_calls] == expected
    with client.generate(ASK, tools=TOOLS, **options) as stream:
        chunks = list(stream)
    assert reassembled(chunks) == [(call.name, call.arguments) for call in completion.tool_calls]
    assert "".join(chunk.content or "" for chunk in chunks) == completion.content
    assert completion.content == ("I will look it up." if not options else "")
    assert chunks[-1].finish_reason == "tool_calls"


def test_a_conversation_with_calls_and_results_renders_as_on_http(tool_server: Callable[..., Client],
                                                                  scripted: ScriptedService) -> None:
    scripted.answer("Sunny.")
    completion = tool_server().complete(CALLED, tools=TOOLS)
    assert completion.text == "Sunny." and completion.tool_calls == [] and completion.content == "Sunny."
    expected = ChatCompletionRequest(messages=CALLED, tools=TOOLS).prompt_ids(scripted.tokenizer)
    assert scripted.prompts[-1] == expected
    assert "<tool_response>" in scripted.tokenizer.decode(expected, skip_special_tokens=False)


def test_tool_choice_none_can_leave_the_tools_out_of_the_prompt_on_both_doors(
        tool_server: Callable[..., Client], server_loop: ServerLoop, scripted: ScriptedService) -> None:
    scripted.answer("Fine.")
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}
    shown = ChatCompletionRequest(**body).prompt_ids(scripted.tokenizer)
    hidden = ChatCompletionRequest(messages=ASK).prompt_ids(scripted.tokenizer)
    assert shown != hidden
    tool_server().complete(ASK, tools=TOOLS, tool_choice="none")
    http_post(server_loop, scripted, "/v1/chat/completions", body)
    assert scripted.prompts[-2:] == [shown, shown]  # vLLM's default: shown
    excluding = ToolServing(exclude_tools_when_tool_choice_none=True)
    assert tool_server(excluding).complete(ASK, tools=TOOLS, tool_choice="none").content == "Fine."
    http_post(server_loop, scripted, "/v1/chat/completions", body, exclude_tools_when_tool_choice_none=True)
    assert scripted.prompts[-2:] == [hidden, hidden]
    tool_server(excluding).complete(ASK, tools=TOOLS, tool_choice="auto")
    assert scripted.prompts[-1] == shown  # only none leaves them out


@pytest.mark.parametrize(("options", "message"), [
    (dict(tools=[WEATHER_TOOL], tool_choice={"function": {"name": "get_time"}}), "'get_time', which is not in tools"),
    (dict(tools=[{"name": "f", "parameters": "{not json"}]), "chat.tools[0].parameters is not valid JSON"),
    (dict(tools=[{"name": "f", "parameters": "[1]"}]), "chat.tools[0].parameters must be a JSON schema object"),
    (dict(tools=[{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}],
          tool_choice="required"), "schema"),
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=[WEATHER_TOOL, WEATHER_TOOL]), "two tools have the same name"),
    (dict(tools=[WEATHER_TOOL], tool_choice="required", structured={"regex": "a+"}), "both constrain"),
])
def test_tool_requests_that_cannot_work_are_invalid_argument(tool_server: Callable[..., Client],
                                                             options: dict[str, Any], message: str) -> None:
    with pytest.raises(ClientError) as error:
        tool_server().complete(ASK, max_tokens=2, **options)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.details


def test_an_unknown_tool_choice_mode_is_invalid_argument(tool_server: Callable[..., Client]) -> None:
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")],
                                              tools=[pb.Tool(name="f")], tool_choice=pb.ToolChoice(mode="always")))
    with pytest.raises(grpc.RpcError) as error:
        tool_server().stub.Complete(request, timeout=WAIT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "chat.tool_choice.mode" in error.value.details()  # type: ignore[attr-defined]


def test_n_choices_each_read_their_own_calls(tool_server: Callable[..., Client], scripted: ScriptedService) -> None:
    scripted.answer('[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]')
    completion = tool_server().complete(ASK, tools=TOOLS, tool_choice="required", n=2)
    assert len(completion.choices) == 2
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls" and choice.content == ""
        assert [(call.name, json.loads(call.arguments)) for call in choice.tool_calls] == [
            ("get_weather", {"city": "Oslo", "days": 2})]
    assert completion.choices[0].tool_calls[0].id != completion.choices[1].tool_calls[0].id
