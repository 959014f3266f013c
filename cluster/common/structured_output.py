"""What a request's output must match: a constraint the sampler enforces token by token.

The front doors set it (`response_format`, or a tool choice that must yield a call), the engine's
grammar backend compiles it; this module is only the vocabulary they share.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """`kind`: "json" (`spec`: a JSON schema as text), "json_object" (any JSON object), "regex",
    "choice" (`spec`: a JSON list of strings, one of which is the output) or "grammar"."""

    kind: str
    spec: str = ""
