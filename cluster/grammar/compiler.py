"""`StructuredOutput` -> a compiled grammar over one tokenizer's vocabulary, cached.

Compiling (parsing a schema, regex or grammar, and checking it against the vocabulary) costs about a
millisecond; copying a compiled grammar into a request's fresh matcher, a microsecond. So each
(kind, spec) compiles once per process and tokenizer, and stays in an LRU cache bounded by count and
by the bytes of its grammars: what a compiled grammar holds grows with its text, and faster for some
shapes (a JSON schema of many properties kept about 200 bytes per byte of its spec), so a client
sending padded schemas would otherwise pin gigabytes in every door and worker. A grammar larger than
an eighth of the budget is compiled for its request and not kept. Every engine
compiles against its model's vocabulary (`GrammarCompiler.from_tokenizer`); the front doors share one
compiler per tokenizer (`shared_compiler`) to refuse a bad spec (ValueError: a 400) before anything
is queued.
"""

from __future__ import annotations

import collections
import json
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cluster.common.errors import missing_package
from cluster.common.structured_output import StructuredOutput
from cluster.grammar.matcher import GrammarMatcher
from cluster.weights.tokenizer import Tokenizer

try:
    import llguidance
except ModuleNotFoundError as error:  # optional: an engine without grammars runs without it
    raise missing_package("llguidance", "structured outputs (JSON schemas, regexes, choices, grammars)") from error

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

DEFAULT_CACHE_SIZE = 512
# Of grammar text: a hundred real schemas of 2 KB; grammars of 32 KB and more are not kept. A
# budget of 1 MiB let 60 distinct 60 KB schemas (padded, under max_grammar_bytes) grow a server by
# 690 MB; with this one, by the memory of the one compiling.
DEFAULT_CACHE_BYTES = 1 << 18
# JSON may put whitespace between its tokens; a run of it is capped, so a small model that falls into
# a loop of newlines (a common failure) must get on with the object instead (this still allows an
# indented object 16 levels deep).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,64}"
# Defaults a schema may override through its own "x-guidance" key (llguidance's JSON options).
JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": JSON_WHITESPACE}


class GrammarCompiler:
    """Compiles and caches grammars for one vocabulary. Thread-safe (a door's event loop and its
    tokenizing threads may share one)."""

    def __init__(self, tokenizer_json: str, eos_token_ids: Sequence[int], vocab_size: int,
                 cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        """`vocab_size`: the masks' width, the model's logits (a checkpoint may pad its embedding past
        the tokenizer's ids); `eos_token_ids` end the output where the grammar allows it to end."""
        if cache_size < 1 or cache_bytes < 1:
            raise ValueError(f"cache_size and cache_bytes must be >= 1, got {cache_size} and {cache_bytes}")
        self.vocab_size = vocab_size
        self.cache_size, self.cache_bytes = cache_size, cache_bytes
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._eos_mask = sum(1 << token_id for token_id in set(eos_token_ids))
        # spec -> (compiled grammar, bytes of its grammar text)
        self._compiled: collections.OrderedDict[StructuredOutput, tuple[llguidance.LLMatcher, int]] = \
            collections.OrderedDict()
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int | None = None,
                       cache_size: int = DEFAULT_CACHE_SIZE, cache_bytes: int = DEFAULT_CACHE_BYTES) -> GrammarCompiler:
        width = max(vocab_size or 0, tokenizer.vocab_size)  # a mask never cuts off a token the tokenizer has
        return cls(tokenizer.to_json(), tokenizer.eos_token_ids, width, cache_size, cache_bytes)

    @property
    def num_cached(self) -> int:
        return len(self._compiled)

    @property
    def num_words(self) -> int:
        """int32 words in one mask."""
        return -(-self.vocab_size // 32)

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar; ValueError if the spec does not compile."""
        return GrammarMatcher(self._compile(structured).deep_copy(), self.num_words)

    def check(self, structured: StructuredOutput) -> None:
        """ValueError, saying what is wrong, unless the spec compiles (then it is cached)."""
        self._compile(structured)

    def _compile(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        with self._lock:
            cached = self._compiled.get(structured)
            if cached is not None:
                self._compiled.move_to_end(structured)
                self.hits += 1
                return cached[0]
        # Outside the lock: llguidance compiles without the GIL, and two threads compiling the same
        # spec at once only waste a millisecond.
        compiled, size = self._build(structured)
        with self._lock:
            self.misses += 1
            if size <= self.cache_bytes // 8 and structured not in self._compiled:
                self._compiled[structured] = (compiled, size)
                self.cached_bytes += size
                while len(self._compiled) > self.cache_size or self.cached_bytes > self.cache_bytes:
                    self.cached_bytes -= self._compiled.popitem(last=False)[1][1]
        return compiled

    def _build(self, structured: StructuredOutput) -> tuple[llguidance.LLMatcher, int]:
        """The compiled grammar and the bytes of its text (what the cache counts)."""
        grammar = grammar_text(structured)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {_NAMES[structured.kind]}: {_reason(matcher.get_error())}")
        if self._allows_only_the_end(matcher):  # the request would have nothing to generate
            raise ValueError(f"the {_NAMES[structured.kind]} allows only an empty output")
        return matcher, len(grammar.encode())

    def _allows_only_the_end(self, matcher: llguidance.LLMatcher) -> bool:
        mask = int.from_bytes(matcher.deep_copy().compute_bitmask(), "little")  # bit i: token i
        return mask & ~self._eos_mask == 0


_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar (its JSON form) for `structured`; ValueError for a spec that does not
    even parse (the rest is checked when it compiles against a vocabulary)."""
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            # Lark string literals take JSON's escapes.
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(choice) for choice in structured.choices()))
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    except ValueError as error:
        raise ValueError(f"invalid {_NAMES[kind]}: {_reason(str(error))}") from None


def _reason(message: str) -> str:
    """An llguidance error without the dump of the parser's state that may follow it."""
    return message.split("<state>")[0].strip() or "no reason given"


_shared: weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def shared_compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    """The front doors' compiler for `tokenizer`, made on first use (building llguidance's view of a
    50k vocabulary takes a few hundred milliseconds) and dropped with the tokenizer."""
    with _shared_lock:
        compiler = _shared.get(tokenizer)
        if compiler is None:
            compiler = _shared[tokenizer] = GrammarCompiler.from_tokenizer(tokenizer)
        return compiler
