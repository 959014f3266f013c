"""A gRPC `Chat` (messages, tools, tool_choice) as the HTTP door's chat request would be.

The messages and tools become the dicts `cluster.serving.tools.template.render_chat` renders, in the
shape the HTTP door gives them, so one conversation is one prompt through either door; `tool_choice`
becomes the `ToolChoice` that constrains the output and reads its calls back.
"""

from __future__ import annotations

import json
from typing import Any

from cluster.grpc_stubs import pdserve_pb2 as pb
from cluster.serving.tools.choice import ToolChoice
from cluster.serving.tools.template import (
    ChatTemplate,
    arguments_for_template,
    check_tool_choice,
    render_chat,
    tool_for_template,
)

TOOL_CHOICE_MODES = ("none", "auto", "required")


def chat_prompt(tokenizer: ChatTemplate, chat: pb.Chat, exclude_tools_when_tool_choice_none: bool = False) -> list[int]:
    """The chat's prompt ids. The offered tools are shown even under tool_choice none (vLLM's
    default), unless the server excludes them then. Raises ValueError naming the field at fault."""
    if not chat.messages:
        raise ValueError("the chat has no messages")
    messages = [_message_for_template(message, index) for index, message in enumerate(chat.messages)]
    tools = [tool_for_template(tool.name, tool.description or None, _parameters_of(tool, index),
                               tool.strict if tool.HasField("strict") else None)
             for index, tool in enumerate(chat.tools)]
    if exclude_tools_when_tool_choice_none and _mode_of(chat) == "none":
        tools = []
    return render_chat(tokenizer, messages, tools or None)


def tool_choice_of(chat: pb.Chat) -> ToolChoice | None:
    """What `tools` and `tool_choice` ask (None: no tools offered). Raises ValueError."""
    names = [tool.name for tool in chat.tools]
    if any(not name for name in names):
        raise ValueError("chat.tools: every tool needs a name")
    function = chat.tool_choice.function if chat.tool_choice.WhichOneof("choice") == "function" else None
    mode = _mode_of(chat)
    check_tool_choice(names, None if function is not None else mode, function)
    if not names:
        return None
    tools = {tool.name: _parameters_of(tool, index) for index, tool in enumerate(chat.tools)}
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    if function is not None:
        return ToolChoice("named", tools, function, parallel)
    return ToolChoice(mode or "auto", tools, parallel=parallel)  # type: ignore[arg-type]  # checked in _mode_of


def _mode_of(chat: pb.Chat) -> str | None:
    if chat.tool_choice.WhichOneof("choice") != "mode":
        return None
    if chat.tool_choice.mode not in TOOL_CHOICE_MODES:
        raise ValueError(f"chat.tool_choice.mode is {chat.tool_choice.mode!r}: use one of "
                         f"{', '.join(TOOL_CHOICE_MODES)} (or set chat.tool_choice.function)")
    return chat.tool_choice.mode


def _parameters_of(tool: pb.Tool, index: int) -> dict[str, Any] | None:
    if not tool.parameters:
        return None
    try:
        parameters = json.loads(tool.parameters)
    except ValueError as error:
        raise ValueError(f"chat.tools[{index}].parameters is not valid JSON: {error}") from None
    if not isinstance(parameters, dict):
        raise ValueError(f"chat.tools[{index}].parameters must be a JSON schema object")
    return parameters


def _message_for_template(message: pb.ChatMessage, index: int) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [_call_for_template(call, index) for call in message.tool_calls]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _call_for_template(call: pb.ToolCall, index: int) -> dict[str, Any]:
    if not call.name:
        raise ValueError(f"chat.messages[{index}].tool_calls: every call needs a name")
    rendered: dict[str, Any] = {"id": call.id} if call.id else {}
    return {**rendered, "type": "function",
            "function": {"name": call.name, "arguments": arguments_for_template(call.arguments)}}
