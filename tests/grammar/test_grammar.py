"""Grammars over a real (tiny, byte-level BPE) vocabulary: what each kind accepts and refuses, the
compile cache, the matcher's states, and errors a door can answer with a 400."""

from __future__ import annotations

import array
import json
from pathlib import Path

import pytest

from cluster.common.structured_output import StructuredOutput
from cluster.grammar.compiler import DEFAULT_CACHE_BYTES, GrammarCompiler, shared_compiler
from cluster.grammar.matcher import GrammarMatcher
from cluster.weights.synthetic import build_tiny_tokenizer
from cluster.weights.tokenizer import Tokenizer

EOS = 2  # <|im_end|> of the tiny tokenizer
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ARITHMETIC_LARK = 'start: expr\nexpr: NUM (("+" | "*") NUM)*\nNUM: /[0-9]+/'
ARITHMETIC_GBNF = 'root ::= num (("+" | "*") num)*\nnum ::= [0-9]+'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer(tokenizer)


def feed(matcher: GrammarMatcher, tokenizer: Tokenizer, text: str) -> bool:
    return all(matcher.accept(token) for token in tokenizer.encode(text, add_special_tokens=False))


def accepts(compiler: GrammarCompiler, tokenizer: Tokenizer, structured: StructuredOutput, text: str) -> bool:
    """Whether `text` is a whole output the grammar allows: its tokens, then the end of sequence."""
    matcher = compiler.matcher(structured)
    return feed(matcher, tokenizer, text) and (matcher.finished or matcher.accept(EOS)) and matcher.finished


def allowed_tokens(matcher: GrammarMatcher, vocab_size: int) -> set[int]:
    """The mask's set bits, read one by one (not with the code under test elsewhere)."""
    words = array.array("i", [0] * matcher.num_words)
    matcher.fill_bitmask(words.buffer_info()[0])
    return {token for token in range(vocab_size) if words[token // 32] >> (token % 32) & 1}


@pytest.mark.parametrize(("structured", "good", "bad"), [
    (StructuredOutput("json", json.dumps(PERSON)), ['{"name": "Ann", "age": 30}', '{"name":"","age":-1}'],
     ['{"name": "Ann"}', '{"name": "Ann", "age": 3.5}', '{"name": "Ann", "age": 30, "x": 1}', "[]"]),
    (StructuredOutput("json_object"), ['{"a": [1, {"b": null}]}', "{}"], ["[1]", '"a"', "{"]),
    (StructuredOutput("regex", r"\d{3}-[a-z]+"), ["123-abc", "000-z"], ["12-abc", "123-", "123-abc!"]),
    (StructuredOutput.of_choices(["Paris", "Rome", 'say "hi"']), ["Paris", "Rome", 'say "hi"'], ["Par", "Madrid"]),
    (StructuredOutput("grammar", ARITHMETIC_LARK), ["1+2*30", "7"], ["1+", "+1", "1-2"]),
    (StructuredOutput("grammar", ARITHMETIC_GBNF), ["1+2*30", "7"], ["1+", "+1", "1-2"]),
])
def test_each_kind_accepts_its_language_and_nothing_else(compiler: GrammarCompiler, tokenizer: Tokenizer,
                                                        structured: StructuredOutput, good: list[str],
                                                        bad: list[str]) -> None:
    assert all(accepts(compiler, tokenizer, structured, text) for text in good)
    assert not any(accepts(compiler, tokenizer, structured, text) for text in bad)


def test_json_whitespace_runs_are_capped_but_indentation_passes(compiler: GrammarCompiler,
                                                                 tokenizer: Tokenizer) -> None:
    structured = StructuredOutput("json", json.dumps(PERSON))
    assert accepts(compiler, tokenizer, structured, json.dumps({"name": "A", "age": 1}, indent=4))
    assert not accepts(compiler, tokenizer, structured, '{"name": "A",' + " " * 65 + '"age": 1}')


@pytest.mark.parametrize(("structured", "reason"), [
    (StructuredOutput("json", '{"type": "nonsense"}'), "invalid JSON schema: .*nonsense"),
    (StructuredOutput("json", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),  # not enforceable: refused
    (StructuredOutput("json", "{not json"), "invalid JSON schema"),
    (StructuredOutput("regex", "(unclosed"), "(?s)invalid regex: .*unclosed group"),
    (StructuredOutput("grammar", "start: undefined_rule"), "invalid grammar: .*undefined_rule"),
    (StructuredOutput("grammar", 'root ::= "a" | missing'), "invalid grammar: .*missing"),
    (StructuredOutput("regex", "(?:)"), "allows only an empty output"),
    (StructuredOutput.of_choices([""]), "allows only an empty output"),
])
def test_specs_that_do_not_compile_raise_value_errors_that_say_why(compiler: GrammarCompiler,
                                                                    structured: StructuredOutput, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        compiler.check(structured)
    with pytest.raises(ValueError, match=reason):
        compiler.matcher(structured)


def test_a_spec_compiles_once_and_its_matchers_are_independent(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler.from_tokenizer(tokenizer)
    choice = StructuredOutput.of_choices(["Paris", "Rome"])
    first, second = compiler.matcher(choice), compiler.matcher(StructuredOutput.of_choices(["Paris", "Rome"]))
    assert (compiler.misses, compiler.hits) == (1, 1)
    assert feed(first, tokenizer, "Paris") and first.finished
    assert not second.finished and feed(second, tokenizer, "Rome") and second.finished  # untouched by `first`
    assert compiler.matcher(choice).finished is False  # nor is the cached grammar


def test_the_cache_keeps_the_most_recently_used_specs(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler.from_tokenizer(tokenizer, cache_size=2)
    a, b, c = (StructuredOutput("regex", pattern) for pattern in ("a+", "b+", "c+"))
    compiler.check(a)
    compiler.check(b)
    compiler.check(a)  # a is now the most recent
    compiler.check(c)  # evicts b
    assert (compiler.misses, compiler.hits) == (3, 1)
    compiler.check(a)
    assert compiler.hits == 2
    compiler.check(b)
    assert compiler.misses == 4


def padded_schema(index: int, properties: int) -> StructuredOutput:
    """A distinct JSON schema of many properties: what a client padding its schemas sends."""
    return StructuredOutput("json", json.dumps({"type": "object", "properties": {
        f"p{index}_{j:05d}": {"type": "string"} for j in range(properties)}}))


def test_the_cache_is_bounded_by_the_bytes_of_its_grammars(tokenizer: Tokenizer) -> None:
    """Many distinct padded schemas pin no more than the byte budget (by count alone, 512 of them
    were kept); one over an eighth of the budget compiles for its request and is not kept."""
    compiler = GrammarCompiler.from_tokenizer(tokenizer)
    for index in range(60):
        compiler.check(padded_schema(index, 200))  # about 6 KB of grammar text each
    assert compiler.cached_bytes <= DEFAULT_CACHE_BYTES and compiler.num_cached < 60
    assert compiler.cached_bytes == sum(size for _, size in compiler._compiled.values())
    small = GrammarCompiler.from_tokenizer(tokenizer, cache_bytes=64_000)
    large = padded_schema(99, 600)
    small.check(large)
    small.check(large)
    assert (small.misses, small.num_cached, small.cached_bytes) == (2, 0, 0)
    small.check(StructuredOutput("regex", "a+"))
    small.check(StructuredOutput("regex", "a+"))
    assert (small.hits, small.num_cached) == (1, 1)


def test_matcher_states_from_start_to_end_or_error(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.matcher(StructuredOutput("regex", "ab+"))
    assert not matcher.finished and not matcher.failed
    assert feed(matcher, tokenizer, "abb") and not matcher.finished  # more b's may follow
    assert EOS in allowed_tokens(matcher, tokenizer.vocab_size)  # ... or the end
    assert matcher.accept(EOS) and matcher.finished and not matcher.failed
    refused = compiler.matcher(StructuredOutput("regex", "ab+"))
    assert EOS not in allowed_tokens(refused, tokenizer.vocab_size)  # not before the grammar allows an end
    assert not feed(refused, tokenizer, "b")
    assert refused.failed and not refused.finished


def test_a_mask_allows_exactly_the_tokens_the_matcher_accepts(compiler: GrammarCompiler,
                                                              tokenizer: Tokenizer) -> None:
    structured = StructuredOutput("json", json.dumps(PERSON))
    matcher = compiler.matcher(structured)
    assert feed(matcher, tokenizer, '{"name": "A')
    allowed = allowed_tokens(matcher, tokenizer.vocab_size)
    for token in range(tokenizer.vocab_size):
        probe = compiler.matcher(structured)
        assert feed(probe, tokenizer, '{"name": "A')
        assert probe.accept(token) == (token in allowed), token


def test_a_mask_is_as_wide_as_the_models_vocabulary(tokenizer: Tokenizer) -> None:
    """A checkpoint may pad its embedding past the tokenizer's ids: those columns are never allowed."""
    compiler = GrammarCompiler.from_tokenizer(tokenizer, vocab_size=tokenizer.vocab_size + 100)
    matcher = compiler.matcher(StructuredOutput("json_object"))
    assert matcher.num_words == -(-(tokenizer.vocab_size + 100) // 32)
    assert max(allowed_tokens(matcher, compiler.vocab_size)) < tokenizer.vocab_size


def test_the_doors_share_one_compiler_per_tokenizer(tokenizer: Tokenizer, tmp_path: Path) -> None:
    other = Tokenizer.from_dir(build_tiny_tokenizer(tmp_path))
    assert shared_compiler(tokenizer) is shared_compiler(tokenizer)
    assert shared_compiler(other) is not shared_compiler(tokenizer)
