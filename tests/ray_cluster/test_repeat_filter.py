"""The router relays one unbroken stream although two workers speak: the prefill worker streams the
first token, the decode worker restates it. What the client gets has every token once, in order."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.common.events import TokenEvent, TokenLogprobs
from cluster.ray_cluster.router import RepeatFilter, SpliceError


def _event(index: int, tokens: list[int], text: str, finished: bool = False) -> TokenEvent:
    logprobs = [TokenLogprobs(token, -1.0, []) for token in tokens]
    return TokenEvent("r", index, tokens, text, finished, "length" if finished else None, 5, "w", 0, logprobs)


def _relay(*events: TokenEvent) -> list[TokenEvent]:
    seen = RepeatFilter()
    return [news for event in events if (news := seen.news(event)) is not None]


def test_the_decode_workers_restated_first_token_is_dropped() -> None:
    relayed = _relay(_event(0, [7], "a"), _event(0, [7], "a"), _event(1, [8], "b"), _event(2, [9], "c", True))
    assert [(e.index, e.token_ids, e.text) for e in relayed] == [(0, [7], "a"), (1, [8], "b"), (2, [9], "c")]


def test_a_restated_first_token_merged_with_the_next_ones_keeps_them() -> None:
    """A decode stream held back by backpressure merges its outputs: [t0, t1, t2] in one event."""
    relayed = _relay(_event(0, [7], "a"), _event(0, [7, 8, 9], "abc"), _event(3, [10], "d", True))
    assert [(e.index, e.token_ids, e.text) for e in relayed] == [(0, [7], "a"), (1, [8, 9], "bc"), (3, [10], "d")]
    assert [entry.token_id for e in relayed for entry in e.logprobs] == [7, 8, 9, 10]


def test_text_the_prefill_held_back_comes_with_the_restatement() -> None:
    """The prefill worker holds back a partial UTF-8 character; the decode worker's restatement
    carries it: kept, as text without a token."""
    relayed = _relay(_event(0, [7], ""), _event(0, [7], "é"), _event(1, [8], "x", True))
    assert [(e.index, e.token_ids, e.text) for e in relayed] == [(0, [7], ""), (1, [], "é"), (1, [8], "x")]


def test_a_restatement_that_ends_the_request_is_relayed_as_its_end() -> None:
    relayed = _relay(_event(0, [7], "a"), _event(0, [7], "a", finished=True))
    assert [(e.index, e.token_ids, e.finished) for e in relayed] == [(0, [7], False), (1, [], True)]


def test_a_restated_first_token_that_differs_is_refused_not_spliced() -> None:
    """The client has token 7 from the prefill; a decode worker that goes on after 9 would splice."""
    with pytest.raises(SpliceError, match="went on after token 9, the client has 7"):
        _relay(_event(0, [7], "a"), _event(0, [9, 8], "xb"))


def test_prompt_logprobs_reach_the_client_once() -> None:
    """The prefill worker's first token carries the prompt's logprobs; a decode worker that computed the
    prompt again (its KV lost) restates the first token with its own: dropped, the client has them."""
    prompt_logprobs = [None, TokenLogprobs(3, -2.0, [])]
    first = replace(_event(0, [7], "a"), prompt_logprobs=prompt_logprobs)
    restated = replace(_event(0, [7, 8], "ab"), prompt_logprobs=prompt_logprobs)
    relayed = _relay(first, restated, _event(2, [9], "c", True))
    assert [e.prompt_logprobs for e in relayed] == [prompt_logprobs, None, None]
    assert [e.token_ids for e in relayed] == [[7], [8], [9]]


def test_a_restated_first_token_without_logprobs_keeps_those_of_the_tokens_after_it() -> None:
    """The decode worker has no logprobs of the first token (the prefill worker sampled it): merged with
    the next ones, its event carries theirs only, and each relayed token keeps its own."""
    restated = _event(0, [7, 8, 9], "abc")
    restated = replace(restated, logprobs=restated.logprobs[1:])
    relayed = _relay(_event(0, [7], "a"), restated, _event(3, [10], "d", True))
    assert [entry.token_id for e in relayed for entry in e.logprobs] == [7, 8, 9, 10]
