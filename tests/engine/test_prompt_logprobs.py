"""Prompt logprobs (vLLM's `prompt_logprobs`) against transformers' log-softmax on the same weights:
over a prompt chunked by a small token budget, and over a prompt whose prefix an earlier request
left in the prefix cache (a request asking them must compute every position, not take the hit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.common.sampling_params import SamplingParams
from cluster.engine.llm_engine import LLMEngine, RequestOutput
from cluster.model import runner
from tests.engine.test_engine_outputs import PROMPTS, assert_pool_whole, checkpoint, make_engine

TOP = 3
__all__ = ["checkpoint"]  # the shared module fixture


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> torch.Tensor:
    """transformers' log-softmax over PROMPTS[3]: row p is the distribution of token p + 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPTS[3]])).logits[0].float().log_softmax(dim=-1)


def outputs_of(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    request = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.request_id == request.request_id]
    return outputs


def assert_matches_oracle(output: RequestOutput, prompt: list[int], expected: torch.Tensor) -> None:
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert entry is not None and entry.token_id == prompt[position]
        row = expected[position - 1]  # the logits at position p predict token p + 1
        assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
        assert entry.rank == int((row > row[prompt[position]]).sum()) + 1
        top_values, top_ids = row.topk(TOP)
        assert [token for token, _ in entry.top] == top_ids.tolist()
        assert [value for _, value in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_prompt_logprobs_match_transformers_across_chunks_and_cached_prefixes(
        checkpoint: Path, expected: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "PROMPT_LOGPROBS_ROWS", 3)  # a chunk's positions go through the lm head in slices
    prompt = PROMPTS[3]  # 34 tokens: five chunks under a budget of 8
    engine = make_engine(checkpoint, budget=8)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    first = outputs_of(engine, prompt, params)
    assert_matches_oracle(first[0], prompt, expected)
    assert all(output.prompt_logprobs is None for output in first[1:])  # with the first token only
    # The same prompt again: its blocks are cached, and would hide all but the last block's logits.
    assert outputs_of(engine, prompt, SamplingParams(max_tokens=1)) and engine.kv_cache.prefix_hits > 0
    again = outputs_of(engine, prompt, params)
    assert_matches_oracle(again[0], prompt, expected)
    assert [o.new_token_ids for o in again] == [o.new_token_ids for o in first]
    assert_pool_whole(engine)


def test_prompt_logprobs_survive_preemption_by_recompute_once(checkpoint: Path, expected: torch.Tensor) -> None:
    """A request preempted mid-prompt and recomputed from scratch reports each position once."""
    prompt = PROMPTS[3]
    engine = make_engine(checkpoint, budget=8, num_blocks=12)  # 34 + 40 tokens do not fit 48 slots together
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    request = engine.add_request(prompt, params)  # the later one: the victim when the first grows
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += [output for output in engine.step() if output.request_id == request.request_id]
    assert request.num_preemptions > 0
    assert_matches_oracle(outputs[0], prompt, expected)
