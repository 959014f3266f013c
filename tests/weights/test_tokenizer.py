"""The runtime tokenizer against transformers on the same files, and streaming detokenization."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.common.errors import ModelLoadError
from cluster.weights.detokenizer import IncrementalDetokenizer
from cluster.weights.synthetic import CHATML_TEMPLATE, build_tiny_tokenizer
from cluster.weights.tokenizer import Tokenizer
from tests.helpers import default_model_dir

os.environ["HF_HUB_OFFLINE"] = "1"

TEXTS = (
    "Hello world!",
    "The capital of France is Paris.",
    "  leading spaces, trailing spaces  ",
    "line one\nline two\n\n\ttabbed",
    "café naïve über 😀 🎉👍🏽 中文 日本語 한국어",
    "<|im_start|>user\nhi<|im_end|>",
    "",
)

CONVERSATIONS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "中文?"},
    ],
)


def transformers_tokenizer(directory: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def bos_variant(root: Path, variant: str) -> Path:
    """Tokenizers that add BOS (id 1) through tokenizer.json's post-processor or not, and ones whose
    tokenizer_config.json states add_bos_token (which transformers 5 ignores next to a tokenizer.json)."""
    directory = build_tiny_tokenizer(root / variant, add_bos_token=variant == "post_processor")
    if variant.startswith("config"):
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["add_bos_token"] = variant == "config_true"
        config_path.write_text(json.dumps(config))
    return directory


# ---- encode / decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["none", "post_processor", "config_true", "config_false"])
def test_encode_and_decode_match_transformers(tmp_path: Path, variant: str) -> None:
    directory = bos_variant(tmp_path, variant)
    ours, reference = Tokenizer.from_dir(directory), transformers_tokenizer(directory)
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == reference.encode(text, add_special_tokens=add_special_tokens), (text, variant)
        for skip_special_tokens in (True, False):
            expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
            assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected
    adds_bos = variant == "post_processor"
    assert (ours.encode("hi")[0] == 1) is adds_bos
    assert ours.encode("hi", add_special_tokens=False)[0] != 1


def test_special_token_ids_and_sizes(tiny: Tokenizer, tiny_dir: Path) -> None:
    reference = transformers_tokenizer(tiny_dir)
    assert (tiny.bos_token_id, tiny.eos_token_id) == (1, 2)
    assert (tiny.bos_token, tiny.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tiny.vocab_size == len(reference)
    assert tiny.token_to_id("<|im_end|>") == 2 and tiny.id_to_token(2) == "<|im_end|>"


@pytest.mark.parametrize(
    ("generation_eos", "expected"), [(None, (2,)), (0, (0, 2)), ([2, 0], (2, 0)), ([0, 2, 0], (0, 2))]
)
def test_eos_token_ids_join_generation_config_and_tokenizer(
    tmp_path: Path, generation_eos: int | list[int] | None, expected: tuple[int, ...]
) -> None:
    directory = build_tiny_tokenizer(tmp_path)
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    assert Tokenizer.from_dir(directory).eos_token_ids == expected


def test_missing_tokenizer_file_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# ---- chat templates -------------------------------------------------------------------------------


@pytest.mark.parametrize("template_file", [False, True], ids=["tokenizer_config", "chat_template.jinja"])
def test_chat_template_renders_like_transformers(tmp_path: Path, template_file: bool) -> None:
    directory = build_tiny_tokenizer(tmp_path, template_file=template_file)
    ours, reference = Tokenizer.from_dir(directory), transformers_tokenizer(directory)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = reference.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    assert ours.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")


FEATURE_TEMPLATE = """{{ bos_token }}{% for message in messages %}
{% if loop.index > limit %}{% break %}{% endif %}
{{ message['role'] | upper }}: {{ message['content'] | tojson }}
{%- if message.name is defined %} ({{ message.name }}){% endif %}

{% endfor %}
{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}
{{ eos_token }} {{ strftime_now('%Y') }}"""


def test_template_globals_filters_and_variables_match_transformers(tmp_path: Path) -> None:
    directory = build_tiny_tokenizer(tmp_path, chat_template=FEATURE_TEMPLATE)
    ours, reference = Tokenizer.from_dir(directory), transformers_tokenizer(directory)
    messages = [
        {"role": "user", "content": 'say "héllo" <b>中文</b>', "name": None},
        {"role": "assistant", "content": "ok", "name": "bot"},
        {"role": "user", "content": "dropped by the limit"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "é"}}]
    kwargs = {"add_generation_prompt": False, "tools": tools, "limit": 2}
    expected = reference.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == expected
    # tojson keeps non-ASCII and HTML as is; None-valued keys are dropped; {% break %} works.
    assert "<b>中文</b>" in expected and "(None)" not in expected and "dropped" not in expected


def test_raise_exception_in_a_template_raises_template_error(tiny: Tokenizer) -> None:
    with pytest.raises(jinja2.TemplateError, match="unknown role: robot"):
        tiny.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_sandbox_blocks_attribute_escapes(tmp_path: Path) -> None:
    directory = build_tiny_tokenizer(tmp_path, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(directory).apply_chat_template(CONVERSATIONS[0])


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(build_tiny_tokenizer(tmp_path, chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])


def test_default_template_is_the_helpers_chatml(tiny: Tokenizer) -> None:
    assert tiny.chat_template == CHATML_TEMPLATE


# ---- IncrementalDetokenizer -----------------------------------------------------------------------


def stream(
    tokenizer: Tokenizer,
    output_ids: list[int],
    prompt_ids: list[int] | None = None,
    stop: tuple[str, ...] = (),
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `output_ids` one at a time (the last with final=True); return the detokenizer and deltas."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids or tokenizer.encode("Question: "), stop=stop)
    deltas = [
        detokenizer.add(token, final=index == len(output_ids) - 1) for index, token in enumerate(output_ids)
    ]
    return detokenizer, deltas


def test_the_tiny_tokenizer_splits_multibyte_characters(tiny: Tokenizer) -> None:
    # Guards the tests below: they only exercise UTF-8 holding back if characters span tokens.
    pieces = [tiny.decode([token]) for token in tiny.encode("😀 中文")]
    assert any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_decoding_everything(tiny: Tokenizer, text: str) -> None:
    output_ids = tiny.encode(text, add_special_tokens=False) + [2]  # then EOS
    detokenizer, deltas = stream(tiny, output_ids)
    expected = tiny.decode(output_ids)
    assert "".join(deltas) == detokenizer.text == expected
    assert all("\ufffd" not in delta for delta in deltas)
    assert detokenizer.output_token_ids == output_ids and not detokenizer.stopped


def test_partial_characters_are_held_back_until_complete(tiny: Tokenizer) -> None:
    output_ids = tiny.encode("😀", add_special_tokens=False)
    assert len(output_ids) > 1
    detokenizer = IncrementalDetokenizer(tiny, [])
    deltas = [detokenizer.add(token) for token in output_ids]
    assert deltas == [""] * (len(output_ids) - 1) + ["😀"]


def test_incomplete_character_at_the_end_is_released_by_finish(tiny: Tokenizer) -> None:
    output_ids = tiny.encode("ok 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    detokenizer = IncrementalDetokenizer(tiny, [])
    streamed = "".join(detokenizer.add(token) for token in output_ids)
    assert streamed == "ok"
    assert streamed + detokenizer.finish() == tiny.decode(output_ids)
    assert detokenizer.text == tiny.decode(output_ids) and detokenizer.finish() == ""


def test_each_step_decodes_only_a_few_tokens(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    lengths: list[int] = []
    decode = tiny.decode

    def recording_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        lengths.append(len(ids))
        return decode(ids, skip_special_tokens)

    output_ids = tiny.encode(" ".join(TEXTS) * 10, add_special_tokens=False)
    monkeypatch.setattr(tiny, "decode", recording_decode)
    detokenizer, deltas = stream(tiny, output_ids, prompt_ids=list(range(3, 200)))
    monkeypatch.undo()
    assert len(output_ids) > 500
    assert max(lengths) <= 12  # 5 tokens of prompt context + one emoji's bytes, never the sequence
    assert "".join(deltas) == tiny.decode(output_ids)


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The capital of France is Paris. It is big.", ("Paris",), "The capital of France is "),
        ("The capital of France is Paris. It is big.", ("is big", "e capital"), "Th"),  # earliest wins
        ("Hello world, hello world", ("o w",), "Hell"),
        ("answer: 中文 and 😀 more", ("文 and 😀",), "answer: 中"),
        ("line one\nline two", ("\n",), "line one"),
        ("no stop here", ("absent", "xyz"), "no stop here"),
    ],
)
def test_stop_strings_cut_the_text_before_them(
    tiny: Tokenizer, text: str, stop: tuple[str, ...], expected: str
) -> None:
    output_ids = tiny.encode(text, add_special_tokens=False)
    detokenizer, deltas = stream(tiny, output_ids, stop=stop)
    assert detokenizer.text == expected == "".join(deltas)
    assert detokenizer.stopped is (expected != text)
    if detokenizer.stopped:
        assert detokenizer.stop_string is not None and text.startswith(expected + detokenizer.stop_string)
        assert detokenizer.add(5) == "" and detokenizer.finish() == ""
    else:
        assert detokenizer.stop_string is None


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The capital of France is Paris. It is big.", ("Paris",), "The capital of France is Paris"),
        ("The capital of France is Paris. It is big.", ("is big", "e capital"), "The capital"),  # earliest wins
        ("line one\nline two", ("\n",), "line one\n"),
    ],
)
def test_include_stop_keeps_the_stop_string_and_cuts_after_it(
    tiny: Tokenizer, text: str, stop: tuple[str, ...], expected: str
) -> None:
    """vLLM's include_stop_str_in_output: the text ends with the matched stop string, streamed or not."""
    output_ids = tiny.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tiny, [], stop=stop, include_stop=True)
    deltas = [detokenizer.add(token) for token in output_ids if not detokenizer.stopped]
    assert detokenizer.stopped and detokenizer.text == expected == "".join(deltas)


def test_stop_string_spanning_tokens_is_found_when_its_last_token_arrives(tiny: Tokenizer) -> None:
    text = "The capital of France is Paris."
    output_ids = tiny.encode(text, add_special_tokens=False)
    stop = "ance is Pa"
    detokenizer = IncrementalDetokenizer(tiny, [], stop=(stop,))
    fed = 0
    while not detokenizer.stopped:
        detokenizer.add(output_ids[fed])
        fed += 1
    # It stopped at the first token that completes the stop string, not before, not after.
    assert stop in tiny.decode(output_ids[:fed])
    assert stop not in tiny.decode(output_ids[: fed - 1])
    assert detokenizer.text == "The capital of Fr"


def test_text_that_may_start_a_stop_string_is_held_back(tiny: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tiny, [], stop=("Paris",))
    streamed = "".join(
        detokenizer.add(token) for token in tiny.encode("We go to Par", add_special_tokens=False)
    )
    # "Par" could still become "Paris": at most len("Paris") - 1 characters are withheld.
    assert "We go to Par".startswith(streamed) and len(streamed) >= len("We go to Par") - 4
    assert not streamed.endswith("Par")
    assert streamed + detokenizer.finish() == "We go to Par" == detokenizer.text


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab cé中😀\n."), max_size=40),
    stop_start=st.integers(0, 40),
    stop_length=st.integers(1, 4),
)
def test_streaming_with_a_stop_string_matches_cutting_the_decoded_text(
    tiny: Tokenizer, text: str, stop_start: int, stop_length: int
) -> None:
    output_ids = tiny.encode(text, add_special_tokens=False)
    full = tiny.decode(output_ids)
    stop = full[stop_start : stop_start + stop_length]
    detokenizer, deltas = stream(tiny, output_ids, stop=(stop,) if stop else ())
    expected = full[: full.find(stop)] if stop else full
    assert "".join(deltas) == detokenizer.text == expected
    assert all("\ufffd" not in delta for delta in deltas)


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab cé中😀\n."), max_size=40),
    stop_start=st.integers(0, 40),
    stop_length=st.integers(1, 4),
)
def test_a_run_resumed_at_any_token_streams_what_one_run_streams(
    tiny: Tokenizer, text: str, stop_start: int, stop_length: int
) -> None:
    """A run cut after any token (its worker lost) and resumed on another with the tokens and the text
    the client has: the held-back text (half a character, a stop string's possible start) is sent by
    the resumed run, and a stop string across the cut is matched."""
    output_ids = tiny.encode(text, add_special_tokens=False)
    full = tiny.decode(output_ids)
    stops = (full[stop_start : stop_start + stop_length],) if full[stop_start : stop_start + stop_length] else ()
    prompt = tiny.encode("Question: ")
    _, whole = stream(tiny, output_ids, prompt, stops)
    for cut in range(1, len(output_ids)):
        first = IncrementalDetokenizer(tiny, prompt, stop=stops)
        streamed = "".join(first.add(token) for token in output_ids[:cut])
        if first.stopped:
            break  # the first run ended there: nothing to resume
        resumed = IncrementalDetokenizer(tiny, prompt, stop=stops)
        resumed.resume(output_ids[:cut], streamed)
        rest = [resumed.add(token, final=index == len(output_ids) - 1)
                for index, token in enumerate(output_ids[cut:], cut) if not resumed.stopped]
        assert streamed + "".join(rest) == "".join(whole), cut
        assert resumed.text == "".join(whole) and resumed.stopped == bool(stops and stops[0] in full)


# ---- the default model's tokenizer ----------------------------------------------------------------


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers() -> None:
    directory = default_model_dir()
    ours, reference = Tokenizer.from_dir(directory), transformers_tokenizer(directory)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        ids = reference.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1 and ours.vocab_size == 49152


@pytest.mark.slow
def test_default_model_streams_multibyte_text_and_stops() -> None:
    tokenizer = Tokenizer.from_dir(default_model_dir())
    text = "Voilà: 😀🎉 中文 日本語 — fin. The end."
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([token]) for token in output_ids)
    detokenizer, deltas = stream(tokenizer, output_ids + [2])
    assert "".join(deltas) == detokenizer.text == text
    assert all("\ufffd" not in delta for delta in deltas)
    detokenizer, deltas = stream(tokenizer, output_ids, stop=("本語 —",))
    assert "".join(deltas) == detokenizer.text == "Voilà: 😀🎉 中文 日"


def test_a_stop_string_twice_in_one_token_stops_at_the_first(tiny: Tokenizer) -> None:
    """One token may bring a stop string twice (here a character repeated inside one token's text):
    the output ends before the first."""
    text = "Hello there, how are you doing today? I am fine, thank you."
    token_ids = tiny.encode(text, add_special_tokens=False)
    doubled = next((token, char) for token in token_ids for char in tiny.decode([token])
                   if char.isalpha() and tiny.decode([token]).count(char) > 1)
    stop = doubled[1]
    detokenizer = IncrementalDetokenizer(tiny, [], stop=(stop,))
    for token in token_ids:
        detokenizer.add(token)
    assert detokenizer.stopped and detokenizer.text == text[:text.index(stop)]


def test_the_earliest_of_several_stop_strings_wins(tiny: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tiny, [], stop=("world", "lo w"))
    for token in tiny.encode("Hello world", add_special_tokens=False):
        detokenizer.add(token)
    assert detokenizer.stopped and detokenizer.text == "Hel" and detokenizer.stop_string == "lo w"


def test_finish_flushes_a_trailing_partial_character_and_still_checks_stop_strings(tiny: Tokenizer) -> None:
    """A stream cut inside a multi-byte character ends with U+FFFD; a stop string completed by that
    flush still cuts the text."""
    token_ids = tiny.encode("ab 😀", add_special_tokens=False)
    cut = next(n for n in range(1, len(token_ids) + 1) if tiny.decode(token_ids[:n]).endswith("\ufffd"))
    detokenizer = IncrementalDetokenizer(tiny, [], stop=("zz",))
    streamed = "".join(detokenizer.add(token) for token in token_ids[:cut])
    tail = detokenizer.finish()
    assert (streamed + tail).endswith("\ufffd") and streamed + tail == detokenizer.text
    assert detokenizer.finish() == ""  # nothing twice
    stopping = IncrementalDetokenizer(tiny, [], stop=(tiny.decode(token_ids[:cut])[-2:],))
    for token in token_ids[:cut]:
        stopping.add(token)
    stopping.finish()
    assert stopping.stopped and not stopping.text.endswith("\ufffd")


def metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer (Llama 2, Mistral): a word's leading space is a "▁" that the
    Metaspace decoder drops at the start of a text. Ids: 1 a special token, 2-4 words."""
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "\u2581Hello": 2, "\u2581world": 3, "\u2581again": 4}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.add_special_tokens(["<s>"])
    return Tokenizer(backend, {}, None)


def test_a_skipped_special_token_keeps_the_space_before_the_next_word() -> None:
    """The special token decodes to nothing: the next word is still decoded after the text before it,
    not at the start of a text, where the decoder would drop its space."""
    tokenizer = metaspace_tokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.add(token) for token in (2, 1, 3, 4)]
    assert deltas == ["Hello", "", " world", " again"]
    assert detokenizer.text == tokenizer.decode([2, 1, 3, 4]) == "Hello world again"


def test_special_tokens_are_streamed_only_when_asked(tiny: Tokenizer) -> None:
    output_ids = [*tiny.encode("Hello", add_special_tokens=False), 2, *tiny.encode(" world", add_special_tokens=False)]
    special = tiny.decode([2], skip_special_tokens=False)
    assert special
    for skip, expected in ((True, "Hello world"), (False, f"Hello{special} world")):
        detokenizer = IncrementalDetokenizer(tiny, [], skip_special_tokens=skip)
        streamed = "".join(detokenizer.add(token) for token in output_ids) + detokenizer.finish()
        assert streamed == detokenizer.text == expected


def test_chat_template_reads_tells_which_variables_a_template_uses(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(build_tiny_tokenizer(tmp_path, chat_template=FEATURE_TEMPLATE))
    assert tokenizer.chat_template_reads("tools") and tokenizer.chat_template_reads("limit")
    assert not tokenizer.chat_template_reads("documents")
    tokenizer.chat_template = None
    assert not tokenizer.chat_template_reads("tools")
