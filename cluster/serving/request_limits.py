"""What one request may ask, checked by both front doors before any work is done for it.

A well-formed request can still cost everyone else: a 4 MB prompt tokenized before it is refused, a
few hundred thousand stop strings searched after every token of a batch shared with other streams,
n choices times 20 logprobs formatted into one answer. Each bound below is checked on the request as
it arrived (before tokenizing, templating or any worker holding anything) and refused with a
ValueError naming the limit: HTTP 400, gRPC INVALID_ARGUMENT. `pdserve serve --request-limit
NAME=VALUE` (repeatable; the Helm chart's `gateway.requestLimits`) changes them; docs/security.md
lists them. This module is light: the front doors import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

# Each choice is an engine request of its own: `n` multiplies the load one request can add (both doors).
MAX_CHOICES = 16


class LimitExceeded(ValueError):
    """A request over one of the limits (a bad request: 400 / INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    # UTF-8 bytes of a prompt's text (all of a chat's messages together), before tokenizing: 1 MiB is
    # more than a 128k-token context holds of ordinary text, and takes seconds to tokenize.
    max_prompt_bytes: int = 1 << 20
    max_messages: int = 1024  # messages of one chat
    max_stop_strings: int = 16  # OpenAI allows 4; vLLM does not bound them
    max_stop_string_bytes: int = 256  # each
    max_stop_token_ids: int = 64
    # Choices times the entries of each generated position's logprobs (its own + top ones): bounds an
    # answer's size per token. 16 choices with 7 top logprobs, or 6 with 20.
    max_logprob_entries: int = 128
    # UTF-8 bytes of the one grammar a request asks for (a JSON schema, regex, grammar or choice list;
    # tool_choice required or named: the tools' schema). Compiling grows faster than the spec (a
    # 190 KB schema of 5,000 properties took 2.3 s and kept 44 MB): 64 KiB is far above a real
    # schema, and every one compiles in the door's shared pool and again on a worker.
    max_grammar_bytes: int = 1 << 16

    @classmethod
    def parse(cls, items: Sequence[str]) -> RequestLimits:
        """Limits from `NAME=VALUE` strings (positive integers), the defaults for the rest."""
        names = {field.name for field in dataclasses.fields(cls)}
        values: dict[str, int] = {}
        for item in items:
            name, _, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if name not in names:
                raise ValueError(f"unknown request limit {name!r}: one of {', '.join(sorted(names))}")
            if not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"request limit {name} must be a positive integer, not {value!r}")
            values[name] = int(value)
        return cls(**values)

    def check_prompt(self, text_bytes: int, messages: int = 0) -> None:
        """A prompt of `text_bytes` UTF-8 bytes (in `messages` chat messages, 0 for a plain prompt):
        a chat's bytes count everything its template renders, tools and template arguments too."""
        if messages > self.max_messages:
            raise LimitExceeded(f"the chat has {messages} messages; at most {self.max_messages} are allowed "
                                "(max_messages)")
        if text_bytes > self.max_prompt_bytes:
            raise LimitExceeded(f"the prompt is {text_bytes} bytes; at most {self.max_prompt_bytes} are allowed "
                                "(max_prompt_bytes)")

    def check_sampling(self, stop: Sequence[str], stop_token_ids: Sequence[int], n: int = 1,
                       logprobs: int | None = None) -> None:
        """Stop strings and ids, and the logprob entries `n` choices with `logprobs` top ones ask for."""
        if len(stop) > self.max_stop_strings:
            raise LimitExceeded(f"{len(stop)} stop strings; at most {self.max_stop_strings} are allowed "
                                "(max_stop_strings)")
        longest = max((len(text.encode("utf-8", "surrogatepass")) for text in stop), default=0)
        if longest > self.max_stop_string_bytes:
            raise LimitExceeded(f"a stop string of {longest} bytes; at most {self.max_stop_string_bytes} are "
                                "allowed (max_stop_string_bytes)")
        if len(stop_token_ids) > self.max_stop_token_ids:
            raise LimitExceeded(f"{len(stop_token_ids)} stop token ids; at most {self.max_stop_token_ids} are "
                                "allowed (max_stop_token_ids)")
        if logprobs is not None and n * (logprobs + 1) > self.max_logprob_entries:
            raise LimitExceeded(f"{n} choices with {logprobs} top logprobs ask for {n * (logprobs + 1)} entries per "
                                f"token; at most {self.max_logprob_entries} are allowed (max_logprob_entries)")

    def check_grammar(self, spec: str) -> None:
        """The spec of the structured output a request asks for (empty: none)."""
        size = utf8_length(spec)
        if size > self.max_grammar_bytes:
            raise LimitExceeded(f"the structured output's spec is {size} bytes; at most {self.max_grammar_bytes} are "
                                "allowed (max_grammar_bytes)")


def utf8_length(text: str) -> int:
    """Bytes of `text` in UTF-8; lone surrogates (valid JSON escapes) count as their 3 bytes."""
    return len(text.encode("utf-8", "surrogatepass"))
