"""The rejection sampler on logits chosen by hand: emitted tokens keep the target distribution
exactly (measured over many rows at once), greedy rows take the argmax, and every row sees its own
position's history (penalties, min_tokens)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.request import Request
from cluster.model.rejection_sampler import position_views, verify
from cluster.model.sampler import Sampler, random_probs

# Two positions over 5 tokens: the draft (token 1) holds 0.4 of the first row's mass.
FIRST = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05]).log()
SECOND = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3]).log()
SAMPLES = 40_000


def request(index: int, params: SamplingParams, output: list[int] | None = None) -> Request:
    made = Request(f"r{index}", [1, 2, 3], params, eos_token_ids=(4,))
    for token in output or []:
        made.append_output_token(token)
    return made


def emitted_tokens(params: SamplingParams, drafts: list[int]) -> list[list[int]]:
    """Every one of SAMPLES requests verifies `drafts` against FIRST, SECOND (then SECOND again)."""
    rows = [FIRST, *[SECOND] * len(drafts)]
    requests = [request(i, params) for i in range(SAMPLES)]
    positions = [view for r in requests for view in position_views(r, drafts)]
    logits = torch.stack(rows * SAMPLES)
    torch.manual_seed(0)
    return verify(Sampler(5, seed=0), logits, positions, [drafts] * SAMPLES).token_ids


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return random_probs(logits.unsqueeze(0).clone(), [request(0, params)])[0]


def frequencies(tokens: list[int]) -> torch.Tensor:
    counts = Counter(tokens)
    return torch.tensor([counts[token] / len(tokens) for token in range(5)])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4),
                                    SamplingParams(temperature=1.0, top_p=0.7)], ids=["plain", "top_k", "top_p"])
def test_every_emitted_token_follows_the_target_distribution(params: SamplingParams) -> None:
    """The first token (the draft, or its replacement) follows the first row's distribution, and the
    token after an accepted draft (the bonus) the second's: the draft changes how often, not what."""
    emitted = emitted_tokens(params, [1])
    first = frequencies([tokens[0] for tokens in emitted])
    assert (first - target(FIRST, params)).abs().max() < 0.012, first
    bonus = frequencies([tokens[1] for tokens in emitted if len(tokens) == 2])
    assert (bonus - target(SECOND, params)).abs().max() < 0.02, bonus
    accepted = sum(len(tokens) == 2 for tokens in emitted) / SAMPLES
    assert abs(accepted - float(target(FIRST, params)[1])) < 0.012  # accepted with probability p(draft)


def test_a_draft_the_filters_drop_is_always_rejected() -> None:
    params = SamplingParams(temperature=1.0, top_k=2)  # keeps tokens 1 and 3
    emitted = emitted_tokens(params, [4, 0])
    assert all(len(tokens) == 1 and tokens[0] in (1, 3) for tokens in emitted)


def test_greedy_rows_accept_while_drafts_are_the_argmax() -> None:
    params = SamplingParams(temperature=0)
    logits = torch.stack([FIRST, SECOND, FIRST, SECOND])  # argmaxes 1, 0 (first of the tie), 1, 0
    for drafts, expected in [([1, 0, 1], [1, 0, 1, 0]), ([1, 3, 1], [1, 0]), ([2, 0, 1], [1])]:
        positions = position_views(request(0, params), drafts)
        assert verify(Sampler(5), logits, positions, [drafts]).token_ids == [expected]


def test_penalties_see_the_drafts_before_each_row() -> None:
    """Frequency penalty: at the second row the first draft is part of the output, which takes its
    token below the runner-up; the row that ignored it would accept the second draft too."""
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    row = torch.tensor([0.0, 5.0, 4.5, 0.0, 0.0])
    logits = torch.stack([row, row, row])
    positions = position_views(request(0, params), [1, 1])
    assert verify(Sampler(5), logits, positions, [[1, 1]]).token_ids == [[1, 2]]


def test_min_tokens_masks_eos_only_in_the_rows_below_it() -> None:
    params = SamplingParams(temperature=0, min_tokens=2)
    row = torch.tensor([3.0, 0.0, 0.0, 0.0, 5.0])  # EOS (4) is the argmax where it is allowed
    logits = torch.stack([row, row, row])
    positions = position_views(request(0, params, output=[0]), [0, 0])  # one token out: row 0 is below
    assert verify(Sampler(5), logits, positions, [[0, 0]]).token_ids == [[0, 4]]


def test_logprobs_are_those_of_each_emitted_token() -> None:
    params = SamplingParams(temperature=0, logprobs=1)
    logits = torch.stack([FIRST, SECOND])
    result = verify(Sampler(5), logits, position_views(request(0, params), [1]), [[1]])
    assert result.token_ids == [[1, 0]]
    assert [(e.token_id, round(e.logprob, 5)) for e in result.logprobs[0]] == \
        [(1, round(float(FIRST.log_softmax(0)[1]), 5)), (0, round(float(SECOND.log_softmax(0)[0]), 5))]
