"""Runtime tokenization: encode, decode and chat templates (streaming detokenization: `detokenizer`).

Reads a Hugging Face checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json,
generation_config.json, chat_template.jinja) with the `tokenizers` package and `jinja2` only:
importing transformers costs seconds and gigabytes that a serving process should not pay.
Behaviour follows transformers 5's `TokenizersBackend` and `apply_chat_template`.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from cluster.common.errors import ModelLoadError

# Named special tokens a chat template may use as variables (transformers passes its special_tokens_map).
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """A checkpoint's tokenizer. Build it with `Tokenizer.from_dir`."""

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None,
        generation_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(special_tokens.get("eos_token"))
        # Generation stops at any of these: instruct models often end turns with a token (<|im_end|>,
        # <|eot_id|>) other than the tokenizer's EOS, and list it in generation_config.json.
        candidates = [*generation_eos_token_ids, self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in candidates if i is not None))

    @classmethod
    def from_dir(cls, path: Path | str) -> Tokenizer:
        """Load the tokenizer of a Hugging Face checkpoint directory."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"no tokenizer.json in {directory}: the checkpoint needs a fast tokenizer file"
            )
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(directory / "tokenizer_config.json")
        special_tokens = _special_tokens(config)
        generation_config = _read_json(directory / "generation_config.json")
        return cls(
            backend,
            special_tokens,
            _chat_template(directory, config),
            _as_id_list(generation_config.get("eos_token_id")),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids this tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what tokenizer.json's post-processor adds.

        That post-processor alone decides whether BOS/EOS are added: like transformers 5, which drops
        tokenizer_config.json's add_bos_token/add_eos_token whenever a tokenizer.json exists.
        """
        # encode_batch lets other threads run while the Rust code works (encode holds the GIL for all
        # of it: seconds for a large prompt, during which a front door's event loop could not run).
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. (transformers' clean_up_tokenization_spaces is not applied: transformers 5 skips
        it for BPE tokenizers too, as it corrupts their output.)"""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it, less padding and truncation: what a grammar engine
        reads the vocabulary and the merges from (`cluster.grammar`)."""
        backend = copy.copy(self._backend)  # the settings below must not change our own encodings
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_variables: Any,
    ) -> str:
        """Render `messages` into a prompt string with the checkpoint's Jinja chat template.

        Extra keyword arguments become template variables (e.g. `enable_thinking=False` for Qwen3).
        """
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json and no "
                "chat_template.jinja); send a plain completion prompt instead, or use an instruct checkpoint"
            )
        # Keys set to None are dropped, as transformers does: APIs send content=None, templates break on it.
        conversation = [
            {key: value for key, value in message.items() if value is not None} for message in messages
        ]
        variables = {**self.special_tokens, **template_variables}
        return self._compiled_template.render(
            messages=conversation, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )

    def chat_template_reads(self, variable: str) -> bool:
        """Whether the chat template uses `variable` (`tools`: whether the model is shown the tools)."""
        if not self.chat_template:
            return False
        return variable in jinja2.meta.find_undeclared_variables(_environment().parse(self.chat_template))

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        assert self.chat_template is not None
        return _environment().from_string(self.chat_template)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)


def _read_json(path: Path) -> dict[str, Any]:
    """The file's JSON object, or {} when the (optional) file is absent."""
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"invalid JSON in {path}: {error}") from error
    return content if isinstance(content, dict) else {}


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """Named special tokens from tokenizer_config.json, where each is a string or an AddedToken dict."""
    tokens: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5 writes it) wins over tokenizer_config.json's entry, as there."""
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(item) for item in value if isinstance(item, int)]
    return []


# --------------------------------------------------------------------------------------------------
# Chat templates, rendered as transformers renders them


class _GenerationTagExtension(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        line = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(line)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _environment() -> jinja2.Environment:
    # Sandboxed: chat templates come with downloaded checkpoints and are untrusted code.
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
