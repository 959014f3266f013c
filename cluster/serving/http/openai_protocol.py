"""The OpenAI API's wire format, as far as the HTTP gateway serves it.

Request bodies, responses, stream chunks and errors as pydantic models, plus the two translations the
gateway needs: a request body into per-choice `SamplingParams`, and a choice's `TokenEvent`s into
response objects. Names, defaults and shapes follow OpenAI's API reference; the extra sampling fields
(`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`) are vLLM's,
which clients send as extra body fields. Unknown fields are ignored, as OpenAI and vLLM do; fields
this server could only ignore wrongly (`logit_bias`, `functions`, ...) are refused instead: which
field is which is `request_fields`.

Tool calling (`tools`, `tool_choice`, `parallel_tool_calls`, `tool` messages) is described here as it
travels; what it means, how calls are constrained and read back, is `cluster.serving.tools`.

The sampling fields carry the ranges `SamplingParams` accepts, so the OpenAPI document states them and
a value out of range is refused naming its field; what one field cannot say (`min_tokens` at most
`max_tokens`, a prompt that fits the context) `SamplingParams` and the service check.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.common.events import TokenEvent, TokenLogprobs
from cluster.common.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from cluster.serving.cache_domains import check_cache_salt
from cluster.serving.http.request_fields import CHAT_FIELDS, COMPLETION_FIELDS, FieldRule, refused_field
from cluster.serving.http.structured_outputs import StructuredOutputFields
from cluster.serving.request_limits import MAX_CHOICES, RequestLimits, utf8_length
from cluster.serving.tools.calls import CallDelta, Item, Reply, new_call_id
from cluster.serving.tools.choice import ToolChoice
from cluster.serving.tools.parsers import DEFAULT_PARSER, CallFormat, parser_named
from cluster.serving.tools.stream import CallStream, parse
from cluster.serving.tools.template import (
    arguments_for_template,
    check_tool_choice,
    checked_text,
    render_chat,
)
from cluster.weights.tokenizer import Tokenizer

MAX_LOGPROBS = 20  # as vLLM (OpenAI allows 5 for completions, 20 for chat)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default, kept by vLLM
# torch seeds a generator from 64 bits and the engine seeds one per request as it samples: a larger
# seed would fail the engine's step, and every other request in it. (Choice i's seed + i may pass
# 2**63 - 1: torch takes seeds up to 2**64 - 1.)
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1  # gRPC's int32
# Arguments of the chat template's own call: a template variable of the same name would collide.
TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools")


# ---- requests --------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(StructuredOutputFields):
    """The fields that completions and chat completions share (the structured-output ones inherited)."""

    # Python's JSON parser reads NaN and Infinity, which are not JSON, and no sampling value means them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    # What this endpoint does with each field it knows (`request_fields`): some are refused, not ignored.
    request_fields: ClassVar[Mapping[str, FieldRule]] = COMPLETION_FIELDS

    model: str | None = None  # None: the served model
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    # OpenAI's: token id (a JSON key, so text) -> a bias added to its logit before sampling.
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS)
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)  # vLLM's: lower first, under the priority policy
    user: str | None = None
    # vLLM's: each prompt token's logprob and the N most likely there (not streamed, as vLLM)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string stays in the text
    skip_special_tokens: bool = True  # vLLM's
    # vLLM's: the request shares prefix-cache blocks only with requests of the same salt (`cache_domains`).
    cache_salt: str | None = None

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, salt: str | None) -> str | None:
        return check_cache_salt(salt)

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        """JSON null means "not set" in OpenAI's API: drop it so the field's default applies."""
        if not isinstance(data, dict):
            return data
        if (name := refused_field(cls.request_fields, data)) is not None:
            raise ValueError(f"{name} is not supported by this server")
        return {key: value for key, value in data.items() if value is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_limits(self, limits: RequestLimits) -> None:
        """This request against `limits`, before any work (tokenizing included): LimitExceeded."""
        limits.check_prompt(self.prompt_bytes(), self.num_messages())
        limits.check_sampling(_as_list(self.stop), self.stop_token_ids or (), self.n, self.logprobs_asked())
        limits.check_grammar(self.grammar_spec())

    def grammar_spec(self) -> str:
        """The spec of the structured output asked for ("" for free text); ValueError if malformed."""
        structured = self.structured_output()
        return structured.spec if structured is not None else ""

    def prompt_bytes(self) -> int:
        """UTF-8 bytes of the prompt's text (0 for token ids)."""
        raise NotImplementedError

    def num_messages(self) -> int:
        return 0

    def logprobs_asked(self) -> int | None:
        """Top logprobs per generated token, None if no logprobs at all."""
        raise NotImplementedError

    def choice_params(self, max_tokens: int, logprobs: int | None,
                      prompt_logprobs: int | None = None) -> list[SamplingParams]:
        """One `SamplingParams` per choice. With a seed, choice i samples with `seed + i`: the same
        seed for all would make the n choices identical. Raises ValueError for invalid values."""
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as vLLM)")
        params = SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=tuple(_as_list(self.stop)),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=logprobs, priority=self.priority,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            logit_bias=tuple(sorted((self.logit_bias or {}).items())),
            structured=self.structured_output())
        if self.seed is None:
            return [params] * self.n
        return [dataclasses.replace(params, seed=self.seed + i) for i in range(self.n)]


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(COMPLETION_DEFAULT_MAX_TOKENS, ge=0)  # 0: only with echo (the prompt alone)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool = True
    echo: bool = False  # the answer's text (and logprobs) begin with the prompt's

    def prompt_bytes(self) -> int:
        texts = [self.prompt] if isinstance(self.prompt, str) else [p for p in self.prompt if isinstance(p, str)]
        return sum(utf8_length(text) for text in texts)

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt's token ids: text is encoded with the tokenizer's special tokens (BOS), as vLLM does."""
        prompt = self._one_prompt()
        if isinstance(prompt, str):
            return tokenizer.encode(checked_text(prompt), add_special_tokens=self.add_special_tokens)
        if prompt and (min(prompt) < 0 or max(prompt) >= tokenizer.vocab_size):  # before `echo` decodes it
            raise ValueError(f"prompt token ids must be in [0, {tokenizer.vocab_size}): the vocabulary's ids")
        return prompt

    def _one_prompt(self) -> str | list[int]:
        """The one prompt, text or token ids (mypy cannot narrow a list by its elements)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            prompt = prompt[0]
        return cast("str | list[int]", prompt)

    def echo_of(self) -> Echo | None:
        """What `echo` returns before the answer: a text prompt as sent (a token-id prompt is decoded
        once tokenized, `Echo.start`); with max_tokens 0 the prompt alone, as vLLM."""
        if not self.echo:
            return None
        prompt = self._one_prompt()
        return Echo(prompt if isinstance(prompt, str) else None, only=self.max_tokens == 0)

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> list[SamplingParams]:
        requested = self.max_tokens if "max_tokens" in self.model_fields_set else None
        if requested == 0:  # vLLM's echo without generation: one token is computed, the prompt returned
            if not self.echo:
                raise ValueError("max_tokens must be at least 1 (0 only with echo, which returns the prompt alone)")
            requested = 1
        max_tokens = fit_max_tokens(requested, COMPLETION_DEFAULT_MAX_TOKENS, num_prompt_tokens, max_model_len)
        # As vLLM: echo with logprobs returns the prompt tokens' logprobs too.
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self.choice_params(max_tokens, self.logprobs, prompt_logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class MessageFunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; a few clients send the object


class MessageToolCall(BaseModel):
    """A call in an assistant message of the conversation so far (the answer of a previous turn)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall

    def for_template(self) -> dict[str, Any]:
        """As chat templates take it: the arguments as an object (transformers' convention; Llama
        and Mistral templates write `arguments | tojson`). Text that is no JSON object stays text."""
        call = self.model_dump(exclude_none=True)
        call["function"]["arguments"] = arguments_for_template(self.function.arguments)
        return call


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ...: handed to the template as is

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (content may then be null)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        """The message's text as the template gets it ("" for none; parts joined, unchecked)."""
        if isinstance(self.content, list):
            return "\n".join(part.text or "" for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        # No content is "" (as vLLM): templates add message['content'] to strings.
        message["content"] = "\n".join(_text_of(part) for part in self.content) \
            if isinstance(self.content, list) else self.content or ""
        if self.tool_calls is not None:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


class ChatCompletionRequest(SamplingRequest):
    request_fields: ClassVar[Mapping[str, FieldRule]] = CHAT_FIELDS

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI for max_completion_tokens; both work
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's: the template has them
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: template variables (enable_thinking=False)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if isinstance(self.tool_choice, NamedToolChoice):
            check_tool_choice(names, None, self.tool_choice.function.name)
        else:
            check_tool_choice(names, self.tool_choice, None)
        return self

    def prompt_bytes(self) -> int:
        """The messages' text and what the template renders beside it: the tools and template arguments."""
        rendered = [tool.model_dump_json(exclude_none=True) for tool in self.tools or ()]
        if self.chat_template_kwargs:
            rendered.append(json.dumps(self.chat_template_kwargs, default=str))
        return sum(utf8_length(text) for text in [*(message.text() for message in self.messages), *rendered])

    def grammar_spec(self) -> str:
        """The structured output's spec, or the one tool_choice (required, named) holds calls to."""
        tools = self.chosen_tools()
        structured = tools.structured_output() if tools is not None else None
        return structured.spec if structured is not None else super().grammar_spec()

    def num_messages(self) -> int:
        return len(self.messages)

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The rendered chat template (`cluster.serving.tools.template`, as the gRPC door renders it).
        Raises ValueError, or jinja2's TemplateError from the template."""
        messages = [message.for_template() for message in self.messages]
        # Offered tools are rendered even with tool_choice "none", as vLLM does by default (the
        # gateway drops them first when the server excludes them).
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None
        return render_chat(tokenizer, messages, tools, add_generation_prompt=self.add_generation_prompt,
                           add_special_tokens=self.add_special_tokens, variables=self.template_variables())

    def template_variables(self) -> dict[str, Any]:
        variables = self.chat_template_kwargs or {}
        if taken := [name for name in TEMPLATE_ARGUMENTS if name in variables]:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own fields do")
        return variables

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> list[SamplingParams]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        requested = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        max_tokens = fit_max_tokens(requested, None, num_prompt_tokens, max_model_len)
        params = self.choice_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        tools = self.chosen_tools()
        if tools is None or (structured := tools.structured_output()) is None:
            return params
        if params[0].structured is not None:
            raise ValueError("tool_choice (required or a named function) and a structured output (response_format, "
                             "guided_*, structured_outputs) both constrain the answer: send one of them")
        return [dataclasses.replace(choice, structured=structured) for choice in params]

    def chosen_tools(self) -> ToolChoice | None:
        """What `tools` and `tool_choice` ask (None: no tools offered)."""
        if not self.tools:
            return None
        tools = {tool.function.name: tool.function.parameters for tool in self.tools}
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolChoice("named", tools, self.tool_choice.function.name, self.parallel_tool_calls)
        return ToolChoice(self.tool_choice or "auto", tools, parallel=self.parallel_tool_calls)


def fit_max_tokens(requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens a request may generate. A default (None: the rest of the context) shrinks to
    fit; an explicit value that cannot fit is an error, as in vLLM, rather than a silent cut."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ValueError(f"the prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} "
                         "tokens, including at least one generated token")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise ValueError(f"max_tokens is {requested}, but the prompt has {num_prompt_tokens} tokens and the "
                         f"context is {max_model_len}: at most {room} tokens can be generated")
    return requested


def _as_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


def _text_of(part: ContentPart) -> str:
    if part.type != "text" or part.text is None:
        raise ValueError(f"only text content parts are supported, got {part.type!r}")
    return part.text


# ---- responses -------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV the prefix cache already held


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    """Completions' logprobs: parallel lists, one entry per generated token (per echoed prompt token
    first, with echo: the prompt's first token has None, as it has no context)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry for a token at a prompt position: its logprob, its rank in the vocabulary."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token (None for the first), the token and the top N by id.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


def _omitted_if_none() -> Any:
    """A field left out of the JSON when None, rather than null (its schema stays the field's own)."""
    return Field(None, exclude_if=lambda value: value is None)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = _omitted_if_none()  # when asked, in the whole answer only


class CompletionResponse(BaseModel):
    """A completion, and each chunk of a streamed one (OpenAI uses the same shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str  # new_call_id()
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: only tool calls
    tool_calls: list[ToolCall] | None = _omitted_if_none()  # as OpenAI: no key when there are none


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = _omitted_if_none()  # vLLM's, when asked (never streamed)


# Deltas leave out the fields they do not change, rather than sending them null.


class FunctionCallDelta(BaseModel):
    name: str | None = _omitted_if_none()
    arguments: str | None = _omitted_if_none()


class ToolCallDelta(BaseModel):
    """A piece of call `index`: its first names it (with `id` and `type`), the rest add arguments."""

    index: int
    id: str | None = _omitted_if_none()
    type: Literal["function"] | None = _omitted_if_none()
    function: FunctionCallDelta | None = _omitted_if_none()


class ChatDelta(BaseModel):
    """What a chunk adds to the message."""

    role: Literal["assistant"] | None = _omitted_if_none()
    content: str | None = _omitted_if_none()
    tool_calls: list[ToolCallDelta] | None = _omitted_if_none()


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the last chunk, when stream_options.include_usage


# ---- from engine events to responses ---------------------------------------------------------------


@dataclass(slots=True)
class Choice:
    """One choice's output so far, gathered from its `TokenEvent`s."""

    index: int
    pieces: list[str] = field(default_factory=list)
    num_chars: int = 0
    num_tokens: int = 0
    num_cached_tokens: int = 0  # of the prompt, as the engine that computed it found them in its cache
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first event, when asked

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> None:
        self.pieces.append(event.text)
        self.num_chars += len(event.text)
        self.num_tokens += len(event.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        self.logprobs.extend(event.logprobs)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.finished:
            self.finish_reason = str(event.finish_reason or "stop")


class _Format:
    """What both endpoints' response builders share: the response's identity, and whether to send logprobs."""

    def __init__(self, response_id: str, model: str, tokenizer: Tokenizer, logprobs: bool) -> None:
        self.response_id, self.model, self.tokenizer, self.logprobs = response_id, model, tokenizer, logprobs
        self.created = int(time.time())

    def sends(self, event: TokenEvent) -> bool:
        """Whether `event` deserves a chunk: text held back (an incomplete character, a possible stop
        string) leaves nothing to send, unless its token's logprobs are due."""
        return bool(event.text or event.finished or self.logprobs)

    def start(self, prompt: list[int]) -> None:
        """The request's prompt, once tokenized (before any event)."""

    def prompt_logprobs(self, choice: Choice) -> PromptLogprobs | None:
        entries = choice.prompt_logprobs
        return None if entries is None else [None if e is None else self._prompt_entry(e) for e in entries]

    def _prompt_entry(self, entry: TokenLogprobs) -> dict[int, PromptLogprob]:
        """As vLLM: the prompt token's entry, then the top N (ranked 1..N); a token among both once."""
        result = {entry.token_id: PromptLogprob(logprob=entry.logprob, rank=entry.rank or None,
                                                decoded_token=_token_text(self.tokenizer, entry.token_id))}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            result.setdefault(token_id, PromptLogprob(logprob=logprob, rank=rank,
                                                      decoded_token=_token_text(self.tokenizer, token_id)))
        return result


@dataclass(slots=True)
class Echo:
    """Completions' `echo`: the prompt's text (and its tokens' logprobs) before the answer's, in the
    first chunk of a stream; `only` (max_tokens 0): the prompt instead of the answer."""

    text: str | None  # None until `start` decodes a token-id prompt
    only: bool = False
    token_ids: list[int] = field(default_factory=list)
    sent: set[int] = field(default_factory=set)  # streamed choices whose first chunk carried the prompt


class CompletionFormat(_Format):
    """Builds `/v1/completions` responses and chunks (with `echo`, the prompt's first)."""

    def __init__(self, response_id: str, model: str, tokenizer: Tokenizer, logprobs: bool,
                 echo: Echo | None = None) -> None:
        super().__init__(response_id, model, tokenizer, logprobs)
        self.echo = echo

    def start(self, prompt: list[int]) -> None:
        if self.echo is not None:
            self.echo.token_ids = prompt
            if self.echo.text is None:
                self.echo.text = self.tokenizer.decode(prompt, skip_special_tokens=False)

    def opening(self, num_choices: int) -> list[BaseModel]:
        return []

    def chunks(self, choice: Choice, event: TokenEvent) -> list[BaseModel]:
        """The chunks for `event`, already added to `choice`: none when it carries nothing to send."""
        echo = self.echo
        echoes = echo is not None and choice.index not in echo.sent
        if not (self.sends(event) or echoes):
            return []
        text, entries = ("", []) if echo is not None and echo.only else (event.text, event.logprobs)
        logprobs = None
        if self.logprobs:
            offset = self._echoed_chars() + choice.num_chars - len(event.text)  # where this event's text starts
            logprobs = completion_logprobs(self.tokenizer, entries, offset)
        if echoes:
            assert echo is not None
            echo.sent.add(choice.index)
            text = (echo.text or "") + text
            logprobs = self._with_prompt(choice, logprobs)
        reason = choice.finish_reason if event.finished else None
        return [self._wrap([CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                             finish_reason=reason)])]

    def _echoed_chars(self) -> int:
        return len(self.echo.text or "") if self.echo is not None else 0

    def _with_prompt(self, choice: Choice, logprobs: CompletionLogprobs | None) -> CompletionLogprobs | None:
        """`logprobs` after the echoed prompt's (as vLLM: the first token's logprob None)."""
        if logprobs is None or self.echo is None:
            return logprobs
        entries = choice.prompt_logprobs or [None] * len(self.echo.token_ids)
        prompt = echoed_logprobs(self.tokenizer, self.echo.token_ids, entries)
        return CompletionLogprobs(tokens=prompt.tokens + logprobs.tokens,
                                  token_logprobs=prompt.token_logprobs + logprobs.token_logprobs,
                                  top_logprobs=prompt.top_logprobs + logprobs.top_logprobs,
                                  text_offset=prompt.text_offset + logprobs.text_offset)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._wrap([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel:
        return self._wrap([self._choice(choice) for choice in choices], usage)

    def _choice(self, choice: Choice) -> CompletionChoice:
        """The whole choice; with echo and logprobs the offsets run on over the prompt's tokens, as vLLM's."""
        echo = self.echo
        text, entries = ("", []) if echo is not None and echo.only else (choice.text, choice.logprobs)
        offset = sum(len(_token_text(self.tokenizer, t)) for t in echo.token_ids) if echo is not None else 0
        logprobs = completion_logprobs(self.tokenizer, entries, offset) if self.logprobs else None
        if echo is not None:
            text, logprobs = (echo.text or "") + text, self._with_prompt(choice, logprobs)
        return CompletionChoice(index=choice.index, text=text, logprobs=logprobs, finish_reason=choice.finish_reason,
                                prompt_logprobs=self.prompt_logprobs(choice))

    def _wrap(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage)


class ChatFormat(_Format):
    """Builds `/v1/chat/completions` responses and chunks. With `tools` offered, each choice's text is
    read into tool calls (`cluster.serving.tools`): under tool_choice auto by `parser`, the format
    of the server's model. A streamed call opens with a delta naming it (with its id and arguments
    ""), and deltas of its arguments follow, as OpenAI's stream does."""

    def __init__(self, response_id: str, model: str, tokenizer: Tokenizer, logprobs: bool,
                 tools: ToolChoice | None = None, parser: CallFormat | None = None) -> None:
        super().__init__(response_id, model, tokenizer, logprobs)
        self.tools, self.parser = tools, parser or parser_named(DEFAULT_PARSER)
        self.streams: dict[int, CallStream | None] = {}  # per choice, made at its first text
        self.called: set[int] = set()  # the choices that streamed a call

    def opening(self, num_choices: int) -> list[BaseModel]:
        """A stream starts by naming the speaker, once per choice, as OpenAI's does."""
        # Under required or a named function there is no content: null, as in the whole answer.
        content = None if self.tools is not None and self.tools.mode in ("required", "named") else ""
        return [self._wrap([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=content))])
                for index in range(num_choices)]

    def chunks(self, choice: Choice, event: TokenEvent) -> list[BaseModel]:
        deltas = self._deltas(choice.index, event)
        if not deltas and not (event.finished or self.logprobs):
            return []  # text held back: a possible stop string, or a possible tool call
        deltas = deltas or [ChatDelta()]
        logprobs = chat_logprobs(self.tokenizer, event.logprobs) if self.logprobs else None
        reason = _finish_reason(choice.finish_reason, choice.index in self.called) if event.finished else None
        last = len(deltas) - 1
        return [self._wrap([ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs if i == 0 else None,
                                            finish_reason=reason if i == last else None)])
                for i, delta in enumerate(deltas)]

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._wrap([], usage)

    def response(self, choices: list[Choice], usage: Usage) -> BaseModel:
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model, usage=usage,
                                      choices=[self._choice(choice) for choice in choices],
                                      prompt_logprobs=self.prompt_logprobs(choices[0]))

    def _stream(self, index: int) -> CallStream | None:
        if index not in self.streams:
            self.streams[index] = self.tools.call_stream(self.parser) if self.tools is not None else None
        return self.streams[index]

    def _deltas(self, index: int, event: TokenEvent) -> list[ChatDelta]:
        stream = self._stream(index)
        if stream is None:
            return [ChatDelta(content=event.text)] if event.text else []
        items = [*stream.feed(event.text), *(stream.finish() if event.finished else [])]
        return [delta for item in items for delta in self._item_deltas(index, item)]

    def _item_deltas(self, index: int, item: Item) -> list[ChatDelta]:
        if isinstance(item, str):
            return [ChatDelta(content=item)]
        self.called.add(index)
        deltas = []
        if item.name is not None:
            deltas.append(_call_delta(item, id=new_call_id(), type="function",
                                      function=FunctionCallDelta(name=item.name, arguments="")))
        if item.arguments:
            deltas.append(_call_delta(item, function=FunctionCallDelta(arguments=item.arguments)))
        return deltas

    def _choice(self, choice: Choice) -> ChatChoice:
        logprobs = chat_logprobs(self.tokenizer, choice.logprobs) if self.logprobs else None
        stream = self._stream(choice.index)
        reply = parse(stream, choice.text) if stream is not None else Reply(choice.text, ())
        calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
                 for call in reply.calls]
        return ChatChoice(index=choice.index, message=AssistantMessage(content=reply.content, tool_calls=calls or None),
                          logprobs=logprobs, finish_reason=_finish_reason(choice.finish_reason, bool(calls)))

    def _wrap(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage)


def _call_delta(item: CallDelta, **fields: Any) -> ChatDelta:
    return ChatDelta(tool_calls=[ToolCallDelta(index=item.index, **fields)])


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """An answer that ended of itself with calls ends for them; one cut by max_tokens stays "length"."""
    return "tool_calls" if called and reason == "stop" else reason


ResponseFormat = CompletionFormat | ChatFormat


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
    """`offset`: where the first entry's token starts in the choice's text."""
    result = CompletionLogprobs()
    for entry in entries:
        token = _token_text(tokenizer, entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append({_token_text(tokenizer, token_id): logprob for token_id, logprob in entry.top})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def echoed_logprobs(tokenizer: Tokenizer, prompt: list[int], entries: list[TokenLogprobs | None],
                    ) -> CompletionLogprobs:
    """The echoed prompt's logprobs, from offset 0: None where none were computed (the first token)."""
    result, offset = CompletionLogprobs(), 0
    for token_id, entry in zip(prompt, entries, strict=True):
        token = _token_text(tokenizer, token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob if entry is not None else None)
        result.top_logprobs.append(None if entry is None else
                                   {_token_text(tokenizer, top_id): logprob for top_id, logprob in entry.top})
        result.text_offset.append(offset)
        offset += len(token)
    return result


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        TokenLogprob(**_top_logprob(tokenizer, entry.token_id, entry.logprob).model_dump(),
                     top_logprobs=[_top_logprob(tokenizer, token_id, logprob) for token_id, logprob in entry.top])
        for entry in entries])


def _top_logprob(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    token = _token_text(tokenizer, token_id)
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
