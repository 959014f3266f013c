"""The grammar masks of a batch's constrained rows, as tensors.

Per step, for the rows that sample and have a grammar (`Request.grammar`):
  1. `GrammarMasker.start` fills one bit set per row (llguidance, without the GIL) on a thread of its
     own, so the masks compute while the model runs its forward pass (on a GPU, while it waits);
  2. the sampler waits for them and `apply_grammar_masks` sets the logits of every token a row's
     grammar forbids to -inf, before any other processing. Unconstrained rows are not touched.
The matchers are only read here; the request advances its own after the token is sampled.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cluster.grammar.matcher import GrammarMatcher

if TYPE_CHECKING:
    from cluster.engine.request import Request


@dataclass(slots=True)
class GrammarMasks:
    rows: list[int]  # the batch rows (of the sampler's requests) that a grammar constrains
    bitmask: torch.Tensor  # [len(rows), words] int32 on the CPU: bit j of word w allows token 32 * w + j


def grammar_rows(requests: Sequence[Request]) -> list[int]:
    return [row for row, request in enumerate(requests) if request.grammar is not None]


def fill_grammar_masks(requests: Sequence[Request], rows: list[int] | None = None) -> GrammarMasks | None:
    """The masks of `requests`' constrained rows, computed now; None when no row has a grammar.

    Row by row: llguidance's own thread pool (`LLExecutor`) fought torch's threads for the cores,
    and made steps several times slower on a 2-core CPU (docs/structured-outputs.md).
    """
    rows = grammar_rows(requests) if rows is None else rows
    if not rows:
        return None
    matchers: list[GrammarMatcher] = [requests[row].grammar for row in rows]  # type: ignore[misc]
    bitmask = torch.empty((len(rows), matchers[0].num_words), dtype=torch.int32)
    address, row_bytes = bitmask.data_ptr(), bitmask.stride(0) * bitmask.element_size()
    for index, matcher in enumerate(matchers):
        matcher.fill_bitmask(address + index * row_bytes)
    return GrammarMasks(rows, bitmask)


def apply_grammar_masks(logits: torch.Tensor, masks: GrammarMasks) -> None:
    """-inf, in place, wherever a constrained row's grammar forbids the token; other rows untouched."""
    device, vocab_size = logits.device, logits.shape[1]
    allowed = unpack_bitmask(masks.bitmask.to(device, non_blocking=True), vocab_size)
    if len(masks.rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(masks.rows, device=device)
    constrained = logits.index_select(0, index)
    constrained.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, constrained)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bit sets -> [rows, vocab_size] bools (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # An arithmetic shift of a negative word (bit 31 set) still leaves bit j in the lowest place.
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]


class GrammarMasker:
    """Starts each step's masks on a thread, before the forward pass (`overlap`), or computes them
    when asked for (without `overlap`, as `benchmarks/structured_outputs.py` compares)."""

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None  # made at the first grammar

    def start(self, requests: Sequence[Request]) -> concurrent.futures.Future[GrammarMasks | None] | None:
        """The masks of `requests` (the rows the step samples), on their way; None if no row has a grammar."""
        rows = grammar_rows(requests)
        if not rows:
            return None
        if not self.overlap:
            done: concurrent.futures.Future[GrammarMasks | None] = concurrent.futures.Future()
            done.set_result(fill_grammar_masks(requests, rows))
            return done
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._thread.submit(fill_grammar_masks, list(requests), rows)
