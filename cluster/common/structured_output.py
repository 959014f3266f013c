"""What a constrained request asks its output to be: a `StructuredOutput`, carried by `SamplingParams`.

The front doors translate their requests' fields into one (OpenAI's `response_format`, vLLM's
`guided_*` and `structured_outputs`, gRPC's `StructuredOutput` message); the engine compiles it into
a grammar (`cluster.grammar`) whose token mask every sampled token obeys. Only the shape is checked
here (stdlib only, so the SDK and the doors stay light); whether a schema, regex or grammar compiles
is the grammar compiler's to say, with a ValueError that the doors answer with a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# kind -> what `spec` holds
KINDS = {
    "json": "a JSON schema, as JSON text",
    "json_object": "nothing (any JSON object)",
    "regex": "a regular expression (Rust regex syntax) the whole output must match",
    "choice": "a JSON list of strings, one of which is the whole output",
    "grammar": "a context-free grammar in Lark syntax (llguidance's) or GBNF (llama.cpp's), told apart by its rules",
}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The output's required form: `kind` is one of `KINDS`, `spec` what that kind needs.

    Frozen and hashable: it travels inside `SamplingParams` through Ray, and keys the grammar cache.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {sorted(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"a structured output's spec must be a string, got {type(self.spec).__name__}")
        if self.kind == "json_object" and self.spec:
            raise ValueError("a json_object structured output takes no spec")
        if self.kind in ("json", "regex", "grammar") and not self.spec.strip():
            raise ValueError(f"a {self.kind} structured output needs a spec: {KINDS[self.kind]}")
        if self.kind == "choice":
            self.choices()  # a malformed list fails here, not in the engine

    def choices(self) -> list[str]:
        """The strings of a "choice" spec; ValueError unless it is a non-empty JSON list of strings."""
        try:
            choices = json.loads(self.spec)
        except json.JSONDecodeError as error:
            raise ValueError(f"a choice spec must be a JSON list of strings: {error}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("a choice spec must be a non-empty JSON list of strings")
        return choices

    @classmethod
    def of_choices(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(choices))
