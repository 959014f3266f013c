"""Streaming detokenization: one request's output tokens as text deltas, never half a character."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cluster.weights.tokenizer import Tokenizer

# Tokens of the prompt decoded along with the output: some decoders (SentencePiece's Metaspace) render
# a token differently at the start of a text, so the output is always decoded after a little context.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas as they are generated.

    Each `add` decodes only the tokens since the last emitted text (vLLM's prefix/read offsets), so a
    step costs O(a few tokens), not O(sequence). A delta never ends in half a UTF-8 character: while
    the decoded text ends with U+FFFD, its bytes are held back until the next tokens complete it.

    Stop strings follow OpenAI semantics: once one appears in the output, `stopped` is set and the
    text (both `text` and what `add` returns) ends right before it. So as never to stream text that a
    later token turns into a stop string, the last len(longest stop) - 1 characters are held back
    until they cannot start one; with `include_stop` the text ends right after it instead (vLLM's
    include_stop_str_in_output). When the request ends otherwise (EOS, length), pass `final=True`
    with its last token, or call `finish()`, to get what is held back.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._token_ids)  # tokens before it are decoded into `text`
        self._prefix_offset = 0  # decoding starts here, for context
        self._stop = tuple(dict.fromkeys(s for s in stop if s))
        self._include_stop = include_stop
        self._stop_hold = max((len(s) for s in self._stop), default=1) - 1
        self._emitted = 0  # characters of `text` already returned
        self.output_token_ids: list[int] = []
        self.text = ""  # the output so far: complete characters only, cut before a stop string
        self.stopped = False
        self.stop_string: str | None = None

    def add(self, token_id: int, final: bool = False) -> str:
        """Take the next output token; return the text that became safe to stream ("" if none).

        `final=True` says this is the request's last token: everything held back is returned too.
        """
        if self.stopped:
            return ""
        self.output_token_ids.append(token_id)
        self._token_ids.append(token_id)
        previous_length = len(self.text)
        self.text += self._decode_new_text()
        if self._stop:
            self._check_stop(previous_length)
        if final:
            return self.finish()
        safe_end = len(self.text) if self.stopped else len(self.text) - self._stop_hold
        return self._emit_until(safe_end)

    def resume(self, token_ids: Sequence[int], streamed_text: str) -> None:
        """Go on after output tokens generated elsewhere (a run resumed on another worker), of whose text
        the client has `streamed_text`. The text they make beyond it, held back there (half a
        character, the start of a possible stop string), comes with the next delta, and a stop string
        that began in them is matched across the break."""
        for token_id in token_ids:
            self.add(token_id)
        self._emitted = min(len(streamed_text), len(self.text))

    def finish(self) -> str:
        """Everything not yet returned, including a trailing incomplete character (as U+FFFD)."""
        if not self.stopped and self._read_offset < len(self._token_ids):
            previous_length = len(self.text)
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
            full_text = self._decode(self._prefix_offset, len(self._token_ids))
            self.text += full_text[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
            if self._stop:
                self._check_stop(previous_length)
        return self._emit_until(len(self.text))

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _decode_new_text(self) -> str:
        """The text the tokens after the read offset add, or "" while it ends in a partial character."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        full_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHARACTER):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        return full_text[len(prefix_text) :]

    def _check_stop(self, previous_length: int) -> None:
        # A new match must end in the new text, so it starts at most len(stop) - 1 characters before it.
        search_from = max(0, previous_length - self._stop_hold)
        matches = [(index, s) for s in self._stop if (index := self.text.find(s, search_from)) >= 0]
        if matches:
            index, self.stop_string = min(matches)
            self.text = self.text[:index + len(self.stop_string) if self._include_stop else index]
            self.stopped = True

    def _emit_until(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
