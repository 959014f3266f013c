"""What the front doors (HTTP gateway, gRPC server, CLI) serve: a `Service`.

A service takes token ids and sampling parameters and streams `TokenEvent`s back; it knows the
model's name, tokenizer and context length, can abort a request everywhere, and reports its workers'
load. Two implementations:

- `ClusterService` (`cluster.serving.cluster_service`): the Ray cluster (disaggregated or
  colocated), through its routers.
- `LocalService` (`cluster.serving.local_service`): one colocated `Worker` in this process, no Ray:
  `pdserve serve --local`, and the front doors' tests, which then start in a second instead of a Ray
  cluster's ten.

Errors a caller must tell apart (`cluster.common.errors`; the front doors map them to status codes):
`ValueError` for a request that can never run (400), `QueueFullError` and `NoCapacityError` for a
full cluster (429), `ServiceUnavailable` while starting or after stopping (503). Anything else is an
internal error. This module is light: importing it loads no torch, Ray or engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from cluster.common.events import TokenEvent
from cluster.common.loads import WorkerLoad
from cluster.common.sampling_params import SamplingParams
from cluster.grammar.compiler import shared_compiler
from cluster.weights.tokenizer import Tokenizer

# The longest request id a client may send (HTTP `X-Request-Id`, gRPC `request_id`): echoed and
# logged, never used as an engine request id.
MAX_REQUEST_ID_LENGTH = 128


class Service(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def ready(self) -> bool:
        """The model is loaded and the workers a request needs are up (and passed their warm-up)."""
        ...

    @property
    def problem(self) -> str:
        """Why the service is not ready, when it knows (a worker whose warm-up failed); else ""."""
        ...

    def generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[TokenEvent]:
        """Stream the request's events, the last one `finished`. Raises the errors above."""
        ...

    async def abort(self, request_id: str) -> None:
        """End the request wherever it runs and free its blocks on every worker (no error if unknown)."""
        ...

    async def workers(self) -> list[WorkerLoad]:
        """Each worker's load and KV usage, for `pdserve status` and the metrics."""
        ...


def check_prompt(service: Service, prompt: list[int], params: SamplingParams) -> None:
    """Refuse, before anything runs, a request the model cannot take (ValueError -> 400): an empty
    prompt, token ids outside the vocabulary (which would otherwise reach the router's prefix hashes
    and the workers; logit_bias's too), one that cannot fit the context, a structured output whose schema, regex or
    grammar does not compile (compiled once per spec here; the workers compile it again, cached)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    vocab_size = service.tokenizer.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}): the vocabulary's ids")
    if any(token >= vocab_size for token, _ in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}): the vocabulary's ids")
    if len(prompt) + 1 > service.max_model_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens; this model's context holds {service.max_model_len}")
    check_structured(service.tokenizer, params)


def check_structured(tokenizer: Tokenizer, params: SamplingParams) -> None:
    """ValueError unless the request's structured output compiles. The doors call it off their event
    loop first (the first spec of a process also builds the vocabulary's view, a few hundred ms), so
    that `check_prompt`'s own call is a cache hit."""
    if params.structured is not None:
        shared_compiler(tokenizer).check(params.structured)


async def collect(events: AsyncIterator[TokenEvent]) -> list[TokenEvent]:
    """Every event of a stream (tests, the CLI)."""
    return [event async for event in events]

