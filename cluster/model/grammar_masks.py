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
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
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

    Row by row: llguidance's own thread pool (`LLExecutor`) would fight torch's threads for the
    cores, which makes steps several times slower on a machine with few cores
    (docs/structured-outputs.md).
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
    forbidden = forbidden_tokens(masks.bitmask, logits.shape[1], logits.device)
    if len(masks.rows) == logits.shape[0]:
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(masks.rows, device=logits.device)
    constrained = logits.index_select(0, index)
    constrained.masked_fill_(forbidden, float("-inf"))
    logits.index_copy_(0, index, constrained)


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, words] int32 bit sets on the CPU -> [rows, vocab_size] bools on `device`, True where the
    token is forbidden. On the CPU numpy unpacks the bits in one pass (torch's shifts take tens of
    times longer); a GPU unpacks the few words it is sent itself."""
    if device.type == "cpu" and sys.byteorder == "little":
        return forbidden_tokens_numpy(bitmask, vocab_size)
    return forbidden_tokens_torch(bitmask.to(device, non_blocking=True), vocab_size)


def forbidden_tokens_numpy(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # Little-endian words: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7, lowest bit first.
    bits = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size]).view(torch.bool)


def forbidden_tokens_torch(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # An arithmetic shift of a negative word (bit 31 set) still leaves bit j in the lowest place.
    return ((bitmask.unsqueeze(-1) >> shifts) & 1 == 0).flatten(1)[:, :vocab_size]


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
