"""Grammar masks as tensors: bit sets unpacked to the right tokens, written into the right rows, and
applied to those rows only."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.common.structured_output import StructuredOutput
from cluster.engine.request import Request
from cluster.grammar.compiler import GrammarCompiler
from cluster.model.grammar_masks import (
    GrammarMasks,
    apply_grammar_masks,
    fill_grammar_masks,
    forbidden_tokens_numpy,
    forbidden_tokens_torch,
)
from cluster.weights.synthetic import build_tiny_tokenizer
from cluster.weights.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def grammars(tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    tokenizer = Tokenizer.from_dir(build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))
    return GrammarCompiler.from_tokenizer(tokenizer)


def allowed(forbidden: torch.Tensor) -> list[list[int]]:
    return [(~row).nonzero().flatten().tolist() for row in forbidden]


@pytest.mark.parametrize("unpack", [forbidden_tokens_numpy, forbidden_tokens_torch])
def test_unpacking_reads_bit_j_of_word_w_as_token_32w_plus_j(unpack: Callable[[torch.Tensor, int], torch.Tensor]
                                                             ) -> None:
    bitmask = torch.tensor([[1 - 2**31, 1 << 5 | 1 << 12], [0, -1]], dtype=torch.int32)  # bits 0, 31; -1: all
    forbidden = unpack(bitmask, 40)
    assert forbidden.shape == (2, 40) and forbidden.dtype == torch.bool
    assert allowed(forbidden) == [[0, 31, 37], list(range(32, 40))]  # cut at the vocabulary


def test_both_unpackings_agree_on_random_words() -> None:
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, 50), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(forbidden_tokens_numpy(bitmask, 1590), forbidden_tokens_torch(bitmask, 1590))


def test_each_constrained_row_gets_its_own_grammars_mask(grammars: GrammarCompiler) -> None:
    patterns = {1: "[0-9]+", 2: "[a-z]+", 4: "x"}
    requests = [Request(f"r{row}", [1], SamplingParams()) for row in range(5)]
    for row, pattern in patterns.items():
        requests[row].grammar = grammars.matcher(StructuredOutput("regex", pattern))
    masks = fill_grammar_masks(requests)
    assert masks is not None and masks.rows == [1, 2, 4]
    rows = allowed(forbidden_tokens_numpy(masks.bitmask, grammars.vocab_size))
    for index, (row, pattern) in enumerate(patterns.items()):
        expected = [t for t in range(grammars.vocab_size)
                    if grammars.matcher(StructuredOutput("regex", pattern)).accept(t)]
        assert rows[index] == expected, row
    assert fill_grammar_masks(requests[:1]) is None


def test_applying_masks_touches_only_the_constrained_rows() -> None:
    logits = torch.randn(4, 64)
    bitmask = torch.tensor([[0b1010, 0], [0, 1]], dtype=torch.int32)
    masked = logits.clone()
    apply_grammar_masks(masked, GrammarMasks([1, 3], bitmask))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(masked[3]).nonzero().flatten().tolist() == [32]
    assert masked[1, 1] == logits[1, 1] and masked[3, 32] == logits[3, 32]  # allowed tokens keep their logits
