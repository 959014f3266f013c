"""The `n` choices of one gRPC call: their service streams merged into one, and each choice's
text read into tool calls when the chat offered tools.

Each choice is an engine request of its own (`<id>`, or `<id>-<i>` when n > 1). With one choice its
stream is relayed as it is; with more, they are merged (`cluster.serving.merged_streams`, at most
`EVENTS_AHEAD` events ahead of the client), as the HTTP door's `ChoiceStreams` merges them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from cluster.common.events import TokenEvent
from cluster.grpc_stubs import pdserve_pb2 as pb
from cluster.serving.merged_streams import MergedStreams
from cluster.serving.tools.calls import CallDelta, new_call_id
from cluster.serving.tools.choice import ToolChoice
from cluster.serving.tools.parsers import CallFormat
from cluster.serving.tools.stream import CallStream

EVENTS_AHEAD = 64


class ChoiceEvents(Protocol):
    """(choice index, event) of every choice, in arrival order; `aclose` ends the service streams."""

    def __aiter__(self) -> AsyncIterator[tuple[int, TokenEvent]]: ...

    async def __anext__(self) -> tuple[int, TokenEvent]: ...

    async def aclose(self) -> None: ...


def merged(streams: list[AsyncIterator[TokenEvent]]) -> ChoiceEvents:
    return _One(streams[0]) if len(streams) == 1 else MergedStreams(streams, EVENTS_AHEAD)


class _One:
    def __init__(self, stream: AsyncIterator[TokenEvent]) -> None:
        self.stream = stream

    def __aiter__(self) -> _One:
        return self

    async def __anext__(self) -> tuple[int, TokenEvent]:
        return 0, await anext(self.stream)

    async def aclose(self) -> None:
        await self.stream.aclose()  # type: ignore[attr-defined]  # services return async generators


class CallReader:
    """Reads each choice's tool calls out of its text as it streams (`cluster.serving.tools`), and
    writes them into the choice's responses: `content` (the text that is no call) and `tool_calls`
    deltas, a call opening with its id and name and then extending its arguments (as the HTTP door's
    stream). Without tools offered it leaves responses as they are."""

    def __init__(self, tools: ToolChoice | None, parser: CallFormat) -> None:
        self.tools, self.parser = tools, parser
        self.streams: dict[int, CallStream | None] = {}
        self.called: set[int] = set()

    def annotate(self, choice: int, response: pb.GenerateResponse) -> None:
        if self.tools is None:
            return
        if choice not in self.streams:
            self.streams[choice] = self.tools.call_stream(self.parser)
        stream = self.streams[choice]
        if stream is None:  # tool_choice none: all text is content
            response.content = response.text
            return
        items = [*stream.feed(response.text), *(stream.finish() if response.finished else [])]
        response.content = "".join(item for item in items if isinstance(item, str))
        for item in items:
            if isinstance(item, CallDelta):
                response.tool_calls.extend(self._deltas(choice, item))
        if response.finish_reason == pb.FINISH_REASON_STOP and choice in self.called:
            response.finish_reason = pb.FINISH_REASON_TOOL_CALLS  # it ended of itself, for its calls

    def _deltas(self, choice: int, item: CallDelta) -> list[pb.ToolCallDelta]:
        self.called.add(choice)
        deltas = []
        if item.name is not None:
            deltas.append(pb.ToolCallDelta(index=item.index, id=new_call_id(), name=item.name))
        if item.arguments:
            deltas.append(pb.ToolCallDelta(index=item.index, arguments=item.arguments))
        return deltas


def completion_of(responses: list[pb.GenerateResponse], num_choices: int) -> pb.CompleteResponse:
    """A whole call's answer from its stream: each choice's pieces joined, its call deltas assembled
    (so a streamed answer and a whole one are the same calls by construction)."""
    choices = [_choice_of(index, [r for r in responses if r.choice == index]) for index in range(num_choices)]
    lasts = [r for r in responses if r.finished]
    completion_tokens = sum(r.usage.completion_tokens for r in lasts)
    prompt_tokens = lasts[0].usage.prompt_tokens if lasts else 0
    # The prompt counts once however many choices share it: so do its cached tokens (the first choice's).
    cached = next((r.usage.cached_tokens for r in lasts if r.choice == 0), 0)
    usage = pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, cached_tokens=cached)
    first = choices[0]
    response = pb.CompleteResponse(
        request_id=responses[-1].request_id, token_ids=first.token_ids, text=first.text,
        finish_reason=first.finish_reason, logprobs=first.logprobs, usage=usage, choices=choices,
        tool_calls=first.tool_calls)
    if first.HasField("content"):
        response.content = first.content
    return response


def _choice_of(index: int, responses: list[pb.GenerateResponse]) -> pb.CompletionChoice:
    calls: list[pb.ToolCall] = []
    for response in responses:
        for delta in response.tool_calls:
            if delta.id:
                calls.append(pb.ToolCall(id=delta.id, name=delta.name))
            calls[delta.index].arguments += delta.arguments
    finish_reason = responses[-1].finish_reason if responses else pb.FINISH_REASON_UNSPECIFIED
    choice = pb.CompletionChoice(
        index=index, token_ids=[token for r in responses for token in r.token_ids],
        text="".join(r.text for r in responses), finish_reason=finish_reason,
        logprobs=[entry for r in responses for entry in r.logprobs], tool_calls=calls)
    if any(r.HasField("content") for r in responses):
        choice.content = "".join(r.content for r in responses)
    return choice
