"""Fixtures the speculative-decoding tests share: the 8-token model, and its samples without speculation
(the reference each proposer's samples are held to), drawn once per sampling parameters."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import SpeculativeConfig
from cluster.weights.synthetic import build_tiny_llama_checkpoint

PlainMarginals = Callable[[SamplingParams], list[Counter[int]]]
PLAIN_SAMPLES = 4000


@pytest.fixture(scope="session")
def tiny_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model of 8 tokens: each position's distribution is spread enough that drafts are accepted
    and rejected often, and a few thousand samples measure it."""
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("vocab8"), num_layers=1, hidden=32, heads=2,
                                       kv_heads=1, vocab=8)


@pytest.fixture(scope="session")
def plain_marginals(tiny_vocab: Path) -> PlainMarginals:
    """Per position, the counts of PLAIN_SAMPLES samples of `tiny_vocab` without speculation (seeded)."""
    from tests.engine.test_spec_decode import sampled_marginals

    found: dict[SamplingParams, list[Counter[int]]] = {}

    def marginals(params: SamplingParams) -> list[Counter[int]]:
        if params not in found:
            found[params] = sampled_marginals(tiny_vocab, SpeculativeConfig(), params, PLAIN_SAMPLES)[0]
        return found[params]

    return marginals
