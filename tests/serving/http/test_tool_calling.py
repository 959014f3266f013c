"""Tool calling on the chat API, through the official openai client and a live gateway.

A random model never writes a tool call, and a real one only when trained to: where a test needs
the model to call, the service's answer is scripted (`ScriptedService`); the gateway, the client and
everything between them are real. Prompts, and requests without a script, run the tiny model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import ANY

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from pydantic import BaseModel

from cluster.common.events import TokenEvent
from cluster.common.sampling_params import SamplingParams
from cluster.common.structured_output import StructuredOutput
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.serving.http.gateway import build_app, gateway_of
from cluster.serving.http.openai_protocol import ChatCompletionRequest
from cluster.serving.local_service import LocalService
from cluster.serving.tools.choice import required_schema
from cluster.serving.tools.parsers import PARSERS
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.weights.tokenizer import Tokenizer
from tests.helpers import default_model_dir, fp32_model
from tests.serving.http.conftest import Gateways, LiveGateway

MODEL = "tiny-hermes"  # the served name: the checkpoint directory's
# Qwen2.5's way with tools, shortened: the tools in the system turn, calls and results as tagged JSON.
HERMES_TEMPLATE = """{%- if tools %}
<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}{{ "\n" + tool | tojson }}{% endfor %}

</tools>
Call one as <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}
<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{%- elif message.role == "tool" %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{%- else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


class Weather(BaseModel):
    """The weather forecast for a city."""

    city: str
    days: int


WEATHER_TOOL = openai.pydantic_function_tool(Weather, name="get_weather")
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS: list[Any] = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
# The conversation after the call: the assistant's call, then the tool's answer.
PARIS = '{"city": "Paris", "days": 3}'
CALLED = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": PARIS}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees"}]
HERMES_ANSWER = f'I will look it up.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>'


class ScriptedService:
    """A real service whose answer a test may script (`script`: its pieces; None: the model answers).
    What each request asked is kept: `prompts`, `params`."""

    def __init__(self, service: LocalService) -> None:
        self.service = service
        self.script: list[str] | None = None
        self.finish_reason = "stop"
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.service, name)

    def answer(self, text: str, piece: int = 3, finish_reason: str = "stop") -> None:
        """Answer `text`, in pieces of `piece` characters (as a stream of tokens would bring it)."""
        self.script = [text[i:i + piece] for i in range(0, len(text), piece)]
        self.finish_reason = finish_reason

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[TokenEvent]:
        self.prompts.append(prompt)
        self.params.append(params)
        if self.script is None:
            async for event in self.service.generate(prompt, params, request_id):
                yield event
            return
        for index, piece in enumerate(self.script):
            last = index == len(self.script) - 1
            yield TokenEvent(request_id, index, [0], piece, last, self.finish_reason if last else None, len(prompt),
                             "scripted")


@pytest.fixture(scope="module")
def hermes_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hermes_checkpoint(tmp_path_factory.mktemp("hermes") / MODEL)


def build_hermes_checkpoint(path: Path) -> Path:
    """The tiny model with a template that shows tools, and a context that holds them: its byte-level
    vocabulary spends about a token per character of a tool's JSON. Served as its directory's name."""
    path = build_tiny_llama_checkpoint(path)
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE, encoding="utf-8")  # wins over tokenizer_config's
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    return path


@pytest.fixture(scope="module")
def service(gateways: Gateways, hermes_checkpoint: Path) -> ScriptedService:
    config = EngineConfig(model=fp32_model(hermes_checkpoint),
                          cache=CacheConfig(block_size=16, num_blocks=128))
    return ScriptedService(gateways.start_service(config))


@pytest.fixture(scope="module")
def gateway(gateways: Gateways, service: ScriptedService) -> LiveGateway:
    return gateways.serve(service)  # type: ignore[arg-type]


@pytest.fixture
def scripted(service: ScriptedService) -> Iterator[ScriptedService]:
    yield service
    service.script, service.prompts[:], service.params[:] = None, [], []


@pytest.fixture(scope="module")
def client(gateway: LiveGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


def stream(client: openai.OpenAI, **options: Any) -> tuple[list[Any], Any]:
    """The chunks of a streamed chat answer, and the answer the official client reassembles from them."""
    state = ChatCompletionStreamState(input_tools=options.get("tools", openai.omit))
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **options))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return chunks, state.get_final_completion()


def calls_of(message: Any) -> list[tuple[str, Any]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


# ---- tool_choice auto: the model's own format, read by the server's parser ------------------------


def test_auto_reads_the_models_tool_call_out_of_its_answer(client: openai.OpenAI, scripted: ScriptedService) -> None:
    scripted.answer(HERMES_ANSWER)
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "days": 3})]
    call = (choice.message.tool_calls or [])[0]
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > len("call_")
    assert scripted.params[-1].structured is None  # auto: the model writes freely


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client: openai.OpenAI,
                                                               scripted: ScriptedService) -> None:
    scripted.answer(HERMES_ANSWER + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS).choices[0]
    chunks, reassembled = stream(client, messages=ASK, tools=TOOLS)
    deltas = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
    # OpenAI's shape: a call opens with its index, id, type and name, and "" of arguments; then
    # deltas of index and arguments only.
    openings = [delta for delta in deltas if delta.id is not None]
    assert [(d.index, d.type, d.function.name, d.function.arguments) for d in openings] == [
        (0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    assert all(d.type is None and d.function.name is None and d.function.arguments for d in deltas
               if d.id is None)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    final = reassembled.choices[0]
    assert calls_of(final.message) == calls_of(whole.message) == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
    assert final.message.content == whole.message.content == "I will look it up."
    assert final.finish_reason == whole.finish_reason == "tool_calls"


def test_on_the_wire_deltas_leave_out_what_they_do_not_change(gateway: LiveGateway,
                                                               scripted: ScriptedService) -> None:
    scripted.answer('<tool_call>{"name": "get_time"}</tool_call>', piece=100)  # one event, finished
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    choices = [json.loads(line)["choices"][0] for line in lines[:-1]]
    assert [(choice["delta"], choice["finish_reason"]) for choice in choices] == [
        ({"role": "assistant", "content": ""}, None),
        ({"tool_calls": [{"index": 0, "id": ANY, "type": "function", "function": {"name": "get_time",
                                                                                 "arguments": ""}}]}, None),
        ({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, "tool_calls")]
    scripted.answer("Hello")
    whole = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": MODEL, "messages": ASK}).json()
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}  # no tool_calls key


def test_an_answer_without_calls_is_content_as_the_model_wrote_it(client: openai.OpenAI,
                                                                   scripted: ScriptedService) -> None:
    text = "Paris is sunny. Use <tool_call> tags? No need. "
    scripted.answer(text)
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS).choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
    chunks, reassembled = stream(client, messages=ASK, tools=TOOLS)
    assert reassembled.choices[0].message.content == text


def test_without_parallel_calls_auto_keeps_the_first_call(client: openai.OpenAI, scripted: ScriptedService) -> None:
    scripted.answer('<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_time"}</tool_call>')
    message = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                             parallel_tool_calls=False).choices[0].message
    assert calls_of(message) == [("get_time", {})]


def test_tool_choice_none_leaves_the_answer_as_text(client: openai.OpenAI, scripted: ScriptedService) -> None:
    scripted.answer(HERMES_ANSWER)
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none").choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (HERMES_ANSWER, None, "stop")
    assert scripted.params[-1].structured is None


def test_the_tool_call_parser_option_picks_the_models_format(gateways: Gateways, service: ScriptedService,
                                                            scripted: ScriptedService) -> None:
    mistral = gateways.serve(service, tool_call_parser="mistral")  # type: ignore[arg-type]
    client = openai.OpenAI(base_url=f"{mistral.url}/v1", api_key="unused", max_retries=0)
    scripted.answer('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}]')
    message = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS).choices[0].message
    assert calls_of(message) == [("get_weather", {"city": "Rome", "days": 1})]
    assert gateway_of(mistral.app).tool_parser is PARSERS["mistral"]


def test_the_default_parser_is_the_one_the_chat_template_shows(gateway: LiveGateway, caplog: Any) -> None:
    assert gateway_of(gateway.app).tool_parser is PARSERS["hermes"]  # the template writes <tool_call>
    chatml = SimpleNamespace(model_name="chatml", tokenizer=SimpleNamespace(
        chat_template="[TOOL_CALLS] {{ messages }}", chat_template_reads=lambda name: False))
    with caplog.at_level(logging.WARNING, logger="cluster.serving.tools.template"):
        app = build_app(chatml, api_key=None)  # type: ignore[arg-type]
    assert gateway_of(app).tool_parser is PARSERS["mistral"]
    assert "does not render tools" in caplog.text
    with pytest.raises(ValueError, match="unknown tool call parser"):
        build_app(chatml, api_key=None, tool_call_parser="xml")  # type: ignore[arg-type]


# ---- required and named: the grammar holds the model to calls -------------------------------------


def test_a_named_tool_call_parses_and_validates(client: openai.OpenAI, scripted: ScriptedService) -> None:
    scripted.answer('{"city": "Paris", "days": 3}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[WEATHER_TOOL], tool_choice=named)
    message = completion.choices[0].message
    assert message.content is None and len(message.tool_calls or []) == 1
    assert (message.tool_calls or [])[0].function.parsed_arguments == Weather(city="Paris", days=3)
    parameters = WEATHER_TOOL["function"]["parameters"]
    assert scripted.params[-1].structured == StructuredOutput("json", json.dumps(parameters))
    chunks, reassembled = stream(client, messages=ASK, tools=[WEATHER_TOOL], tool_choice=named)
    final = reassembled.choices[0].message
    assert final.content is None and (final.tool_calls or [])[0].function.parsed_arguments == Weather(city="Paris",
                                                                                                       days=3)
    assert len([chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.tool_calls]) > 2  # streamed


def test_required_calls_are_read_from_the_json_array_its_schema_admits(client: openai.OpenAI,
                                                                       scripted: ScriptedService) -> None:
    scripted.answer('[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}, '
                    '{"name": "get_time", "parameters": {}}]')
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            n=2).choices[1]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]
    schemas = {"get_weather": WEATHER_TOOL["function"]["parameters"], "get_time": None}
    expected = StructuredOutput("json", json.dumps(required_schema(schemas)))
    assert [params.structured for params in scripted.params] == [expected, expected]  # each choice
    _, reassembled = stream(client, messages=ASK, tools=TOOLS, tool_choice="required")
    assert calls_of(reassembled.choices[0].message) == calls_of(choice.message)
    client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False)
    serial = scripted.params[-1].structured
    assert serial is not None and json.loads(serial.spec)["maxItems"] == 1


def test_a_call_cut_by_max_tokens_ends_for_length(client: openai.OpenAI, scripted: ScriptedService) -> None:
    scripted.answer('{"city": "Par', finish_reason="length")
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named).choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.tool_calls or [])[0].function.arguments == '{"city": "Par'  # what came


# ---- the conversation: tools, calls and results through the model's template ----------------------


def prompt_text(tokenizer: Tokenizer, **body: Any) -> str:
    return tokenizer.decode(ChatCompletionRequest(**body).prompt_ids(tokenizer), skip_special_tokens=False)


def test_tools_calls_and_results_render_through_the_models_template(hermes_checkpoint: Path) -> None:
    text = prompt_text(Tokenizer.from_dir(hermes_checkpoint), messages=CALLED, tools=TOOLS)
    shown = text[text.index("<tools>") + len("<tools>"):text.index("</tools>")].strip().split("\n")
    assert [json.loads(tool) for tool in shown] == TOOLS  # the tools, as the client sent them
    # The call's arguments reach the template as an object (templates write them with tojson), the
    # call's null content as "".
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", ' \
           '"days": 3}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\nSunny, 24 degrees\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    without_tools = prompt_text(Tokenizer.from_dir(hermes_checkpoint), messages=ASK)
    assert "<tools>" not in without_tools
    # tool_choice none still shows the tools, as vLLM does by default.
    assert "<tools>" in prompt_text(Tokenizer.from_dir(hermes_checkpoint), messages=ASK, tools=TOOLS,
                                    tool_choice="none")


def test_content_parts_and_arguments_that_are_no_json_object_still_render(hermes_checkpoint: Path) -> None:
    messages = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Calling."}], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "noon"}]}]
    text = prompt_text(Tokenizer.from_dir(hermes_checkpoint), messages=messages, tools=TOOLS)
    assert 'Calling.<tool_call>\n{"name": "get_time", "arguments": "not json"}' in text
    assert "<tool_response>\nnoon\n</tool_response>" in text


@pytest.mark.slow
def test_smollm2s_template_renders_the_conversation_but_not_the_tools() -> None:
    """The default model's template knows no tools: it shows a tool's result as a `tool` turn, and the
    assistant's call as an empty turn (vLLM renders the same); the gateway warns at start."""
    tokenizer = Tokenizer.from_dir(default_model_dir())
    text = prompt_text(tokenizer, messages=CALLED, tools=TOOLS)
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\nSunny, 24 degrees<|im_end|>\n" in text
    assert "get_weather" not in text
    assert not tokenizer.chat_template_reads("tools")


def test_the_answers_call_and_its_result_go_back_to_the_model(client: openai.OpenAI,
                                                              scripted: ScriptedService) -> None:
    """The loop of a tool-using application: the answer's message, as the client holds it, goes back
    into the conversation with the tool's result, and the model answers that."""
    scripted.answer(HERMES_ANSWER)
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS).choices[0].message
    call = (first.tool_calls or [])[0]
    scripted.script = None  # the model answers from here
    conversation = [*ASK, first, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees"}]
    response = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=8,
                                              temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = scripted.tokenizer.decode(scripted.prompts[-1], skip_special_tokens=False)
    assert f'I will look it up.<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>' in prompt
    assert prompt.endswith("<tool_response>\nSunny, 24 degrees\n</tool_response><|im_end|><|im_start|>assistant\n")


# ---- what is refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "message"), [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [TIME_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "'get_weather', which is not in tools"),
    ({"tools": [TIME_TOOL, TIME_TOOL]}, "two tools have the same name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": 1}}}],
      "tool_choice": "required"}, "$defs"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tool_choice": "sometimes", "tools": [TIME_TOOL]}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions is not supported"),
    ({"tools": [TIME_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "both constrain the answer: send one of them"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}]}, "messages.0.tool_calls"),
])
def test_tool_requests_that_cannot_work_are_a_400_that_says_why(gateway: LiveGateway, fields: dict[str, Any],
                                                               message: str) -> None:
    body = {"messages": ASK, "max_tokens": 2, **fields}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_the_model_itself_held_to_a_named_call_writes_valid_arguments(client: openai.OpenAI) -> None:
    class Trip(BaseModel):
        city: str
        days: int

    trip = openai.pydantic_function_tool(Trip, name="plan_trip")
    trip["function"]["parameters"]["properties"]["city"]["enum"] = ["Paris", "Rome"]  # short answers
    trip["function"]["parameters"]["properties"]["days"].update(minimum=1, maximum=9)
    completion = client.chat.completions.parse(
        model=MODEL, messages=ASK, tools=[trip], max_tokens=300, temperature=1.0, seed=0,
        tool_choice={"type": "function", "function": {"name": "plan_trip"}})
    parsed = (completion.choices[0].message.tool_calls or [])[0].function.parsed_arguments
    assert isinstance(parsed, Trip) and parsed.city in ("Paris", "Rome")
