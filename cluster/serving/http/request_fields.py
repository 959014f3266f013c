"""Every request field of the two OpenAI endpoints, and what this server does with it.

One table per endpoint: OpenAI's fields and vLLM's extra ones, each supported, refused or ignored
because harmless. A refused field set to anything but null (or a value that asks for nothing, such as
`echo: false`) is a 400 naming it: ignoring it would answer a different question than the one asked.
An ignored field changes nothing the client could notice in the answer (billing tags, cache hints).
A field in no table is ignored as OpenAI and vLLM ignore unknown fields; the tests walk the installed
openai package's request types so a new field must be classified here. docs/gateway.md lists the
tables (`markdown_table`; `python -m cluster.serving.http.request_fields` prints it), and a test
keeps it in step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    SUPPORTED = "supported"
    REFUSED = "refused"
    IGNORED = "ignored (harmless)"


@dataclass(frozen=True, slots=True)
class FieldRule:
    status: Status
    note: str = ""
    # A refused field's values that ask for nothing beyond what the server does anyway (null always passes).
    accepted: tuple[Any, ...] = ()

    def refuses(self, value: Any) -> bool:
        if self.status is not Status.REFUSED or value is None:
            return False
        # `type` too: True == 1, and a field accepting False must not accept 0 silently as if a bool.
        return not any(value == ok and type(value) is type(ok) for ok in self.accepted)


def _supported(note: str = "") -> FieldRule:
    return FieldRule(Status.SUPPORTED, note)


def _refused(note: str, *accepted: Any) -> FieldRule:
    return FieldRule(Status.REFUSED, note, accepted)


def _ignored(note: str) -> FieldRule:
    return FieldRule(Status.IGNORED, note)


_SHARED: dict[str, FieldRule] = {
    "model": _supported("the served model's name (or none)"),
    "n": _supported(),
    "stream": _supported(),
    "stream_options": _supported("include_usage"),
    "max_tokens": _supported(),
    "temperature": _supported(),
    "top_p": _supported(),
    "presence_penalty": _supported(),
    "frequency_penalty": _supported(),
    "seed": _supported("choice i samples with seed + i"),
    "stop": _supported(),
    "logprobs": _supported(),
    "response_format": _supported("structured outputs"),
    "logit_bias": _supported("token id -> bias in [-100, 100]; at most 1024 tokens"),
    "best_of": _refused("vLLM's v1 engine has none either"),
    "user": _ignored("an end-user tag for abuse monitoring"),
    # vLLM's extra sampling and structured-output fields
    "top_k": _supported("vLLM"),
    "min_p": _supported("vLLM"),
    "repetition_penalty": _supported("vLLM"),
    "stop_token_ids": _supported("vLLM"),
    "ignore_eos": _supported("vLLM"),
    "min_tokens": _supported("vLLM"),
    "add_special_tokens": _supported("vLLM; default true for completions, false for chat (the template has them)"),
    "guided_json": _supported("vLLM"),
    "guided_regex": _supported("vLLM"),
    "guided_choice": _supported("vLLM"),
    "guided_grammar": _supported("vLLM"),
    "structured_outputs": _supported("vLLM"),
    "guided_decoding_backend": _ignored("vLLM; this server has one backend (llguidance)"),
    "guided_whitespace_pattern": _refused("vLLM; the grammar's whitespace is llguidance's"),
    "use_beam_search": _refused("vLLM; no beam search", False),
    "length_penalty": _refused("vLLM; beam search only", 1.0),
    "include_stop_str_in_output": _supported("vLLM"),
    "skip_special_tokens": _supported("vLLM"),
    "spaces_between_special_tokens": _refused("vLLM; the tokenizer's own spacing", True),
    "truncate_prompt_tokens": _refused("vLLM; a prompt too long is a 400"),
    "prompt_logprobs": _supported("vLLM; at most 20; not with stream (as vLLM)"),
    "allowed_token_ids": _refused("vLLM"),
    "bad_words": _refused("vLLM"),
    "logits_processors": _refused("vLLM"),
    "priority": _supported("vLLM; lower first; a 400 unless the scheduler's policy is priority"),
    "request_id": _ignored("vLLM; the gateway makes its own ids (X-Request-Id is echoed)"),
    "return_tokens_as_token_ids": _refused("vLLM", False),
    "return_token_ids": _refused("vLLM", False),
    "cache_salt": _supported("vLLM; prefix-cache blocks are shared only with the same salt; at most 256 bytes"),
    "kv_transfer_params": _refused("vLLM; the cluster moves KV caches itself"),
    "vllm_xargs": _refused("vLLM"),
}

CHAT_FIELDS: Mapping[str, FieldRule] = {
    **_SHARED,
    "messages": _supported("text content parts only"),
    "max_completion_tokens": _supported(),
    "top_logprobs": _supported(),
    "tools": _supported("function tools"),
    "tool_choice": _supported(),
    "parallel_tool_calls": _supported(),
    "functions": _refused("OpenAI's API before tools"),
    "function_call": _refused("OpenAI's API before tools"),
    "audio": _refused("text output only"),
    "modalities": _refused("text output only", ["text"]),
    "web_search_options": _refused("no web search"),
    "prediction": _ignored("predicted outputs only make an answer faster, never different"),
    "metadata": _ignored("stored-completion tags"),
    "store": _ignored("nothing is stored"),
    "service_tier": _ignored("one tier"),
    "safety_identifier": _ignored("an end-user tag for abuse monitoring"),
    "moderation": _ignored("OpenAI's moderation settings"),
    "prompt_cache_key": _ignored("prefix caching is automatic"),
    "prompt_cache_retention": _ignored("prefix caching is automatic"),
    "prompt_cache_options": _ignored("prefix caching is automatic"),
    "reasoning_effort": _ignored("for reasoning models' templates; none is served"),
    "verbosity": _ignored("for OpenAI's reasoning models"),
    "include_reasoning": _ignored("vLLM; no reasoning parser, reasoning stays in the content"),
    "add_generation_prompt": _supported("vLLM"),
    "chat_template_kwargs": _supported("vLLM"),
    "continue_final_message": _refused("vLLM", False),
    "documents": _refused("vLLM"),
    "chat_template": _refused("vLLM; a client's template would run on the server"),
    "mm_processor_kwargs": _ignored("vLLM; text-only models (image parts are refused)"),
    "echo": _refused("completions: the prompt (with logprobs, its logprobs) before the answer, max_tokens 0 "
                     "the prompt alone; chat: vLLM's echo of the last message is not served", False),
}

COMPLETION_FIELDS: Mapping[str, FieldRule] = {
    **_SHARED,
    "prompt": _supported("one prompt: text or token ids"),
    "echo": _supported("the prompt (and its logprobs, with logprobs) first; max_tokens 0: the prompt alone"),
    "suffix": _refused("no fill-in-the-middle"),
    "prompt_embeds": _refused("vLLM"),
}


def refused_field(rules: Mapping[str, FieldRule], body: Mapping[str, Any]) -> str | None:
    """The first field of `body` that `rules` refuse at its value, None if none."""
    return next((name for name, value in body.items() if name in rules and rules[name].refuses(value)), None)


def markdown_table() -> str:
    """docs/gateway.md's table of every classified field."""
    names = sorted(CHAT_FIELDS.keys() | COMPLETION_FIELDS.keys())
    lines = ["| field | chat completions | completions | note |", "|---|---|---|---|"]
    for name in names:
        chat, completion = CHAT_FIELDS.get(name), COMPLETION_FIELDS.get(name)
        note = (chat or COMPLETION_FIELDS[name]).note
        lines.append(f"| `{name}` | {_cell(chat)} | {_cell(completion)} | {note} |")
    return "\n".join(lines) + "\n"


def _cell(rule: FieldRule | None) -> str:
    if rule is None:
        return "-"
    if rule.accepted:
        allowed = ", ".join(_json(value) for value in rule.accepted)
        return f"{rule.status} (unless {allowed})"
    return str(rule.status)


def _json(value: Any) -> str:
    return f"`{json.dumps(value)}`"


if __name__ == "__main__":  # python -m cluster.serving.http.request_fields: the table for docs/gateway.md
    print(markdown_table(), end="")
