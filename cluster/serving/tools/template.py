"""A conversation with tools through the model's chat template, the same for both front doors.

The HTTP door (pydantic bodies) and the gRPC door (protobuf messages) each turn their request into
plain dicts in the shape OpenAI's API gives them, and `render_chat` renders those: so one
conversation is the same prompt through either door. The shapes, as templates read them
(transformers' convention):

    tool     {"type": "function", "function": {"name", "description"?, "parameters"?}}
    message  {"role", "content", "tool_calls"?: [{"id", "type": "function",
              "function": {"name", "arguments": <an object>}}], "tool_call_id"?}

`parser_for` picks how the model's tool calls are read, from the template when asked ("auto").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.serving.tools.parsers import CallFormat, detect_parser, parser_named

log = logging.getLogger(__name__)


class ChatTemplate(Protocol):
    """What rendering needs of a tokenizer (`cluster.weights.tokenizer.Tokenizer` has it)."""

    chat_template: str | None

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_variables: Any) -> str: ...

    def chat_template_reads(self, variable: str) -> bool: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def render_chat(tokenizer: ChatTemplate, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                add_generation_prompt: bool = True, add_special_tokens: bool = False,
                variables: dict[str, Any] | None = None) -> list[int]:
    """The rendered chat template, encoded without special tokens by default: the template already
    has them (as `LLMEngine.chat_prompt`). Raises ValueError, or jinja2's TemplateError from the template."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=tools or None, **(variables or {}))
    except TypeError as error:
        # The template met a value of a type it cannot use (a number where it adds strings, say):
        # the client's messages or variables are at fault, as vLLM answers too.
        raise ValueError(f"the chat template cannot render this request: {error}") from error
    return tokenizer.encode(checked_text(text), add_special_tokens=add_special_tokens)


def tool_for_template(name: str, description: str | None, parameters: dict[str, Any] | None,
                      strict: bool | None = None) -> dict[str, Any]:
    """A tool as the HTTP door's `ToolDefinition` dumps it (its unset fields left out)."""
    fields = {"description": description, "parameters": parameters, "strict": strict}
    return {"type": "function", "function": {"name": name, **{k: v for k, v in fields.items() if v is not None}}}


def arguments_for_template(arguments: str | dict[str, Any]) -> str | dict[str, Any]:
    """A call's arguments as templates take them: an object (Llama and Mistral templates write
    `arguments | tojson`). Text that is no JSON object stays text."""
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def check_tool_choice(names: Sequence[str], mode: str | None, function: str | None) -> None:
    """Raises ValueError for tools and a tool_choice that cannot work together. `mode`: "none",
    "auto", "required" or None (auto); `function`: the name a named choice calls."""
    if len(set(names)) < len(names):
        raise ValueError("tools: two tools have the same name")
    if not names and (function is not None or mode not in (None, "none")):
        raise ValueError("tool_choice needs tools: the request offers none")
    if function is not None and function not in names:
        raise ValueError(f"tool_choice names {function!r}, which is not in tools")


def checked_text(text: str) -> str:
    """`text`, if it is Unicode a tokenizer can take. A JSON string may hold half of a UTF-16 surrogate
    pair ("\\ud800"), which Python reads into a str that has no UTF-8 form: refuse it as a bad request."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"the prompt is not valid Unicode: it holds an unpaired UTF-16 surrogate "
                         f"({text[error.start]!r})") from None
    return text


def parser_for(tokenizer: ChatTemplate, name: str, model_name: str) -> CallFormat:
    """The parser `name`, or with "auto" the one for the format the model's chat template shows it."""
    template = tokenizer.chat_template
    if name == "auto":
        name = detect_parser(template)
    if template and not tokenizer.chat_template_reads("tools"):
        log.warning("the chat template of %s does not render tools: under tool_choice auto the model is not "
                    "shown them (required and named tool choices still hold it to calls)", model_name)
    log.info("tool calls under tool_choice auto are read in the %s format", name)
    return parser_named(name)


@dataclass(frozen=True, slots=True)
class ToolServing:
    """How a front door serves chats with tools: `parser`, the format the model writes calls in under
    tool_choice auto ("auto": its template's); `exclude_tools_when_tool_choice_none`, vLLM's flag of
    that name: tool_choice none leaves the tools out of the prompt (off: they are shown, as vLLM)."""

    parser: str = "auto"
    exclude_tools_when_tool_choice_none: bool = False
