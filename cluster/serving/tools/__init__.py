"""Tool calling on the chat API: from a request's `tools` and `tool_choice` to the calls in its answer.

A chat request with tools goes through three steps here:

1. `choice`: its `tool_choice` decides how the model is held to calls. `auto` lets it write freely;
   `required` and a named function constrain its output with a JSON schema (a `StructuredOutput` on
   the request's `SamplingParams`), so the answer always parses. `none` leaves the output as text.
2. The model's text is read back into calls as it streams: `stream` does it incrementally for every
   choice, so a streamed answer and a whole one are the same calls by construction.
3. `parsers`: under `auto` the text is in the model's own format (Hermes/Qwen `<tool_call>`, Llama 3
   JSON, Mistral `[TOOL_CALLS]`), chosen per server by name.

`template` renders a conversation with tools through the model's chat template, the same for both
front doors. The HTTP gateway turns the resulting `calls` into OpenAI's `tool_calls` and their stream
deltas, the gRPC server into `ToolCall` and `ToolCallDelta` messages. Nothing here imports pydantic,
HTTP, gRPC or the engine.
"""
