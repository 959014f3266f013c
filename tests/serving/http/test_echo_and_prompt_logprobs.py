"""vLLM's `prompt_logprobs`, completions' `echo` and `include_stop_str_in_output` through the official
openai client, against the in-process gateway on the tiny random model (prompt logprobs checked
against transformers' log-softmax on the same weights)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.serving.http.conftest import LiveGateway

PROMPT_IDS = [5, 17, 33, 9, 81, 120, 7, 7, 64, 11]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(tiny: LiveGateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint: Path) -> torch.Tensor:
    """transformers' log-softmax over PROMPT_IDS: row p is the distribution of token p + 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT_IDS])).logits[0].float().log_softmax(dim=-1)


def served(client: openai.OpenAI) -> str:
    """The served model's name (the tiny checkpoint directory's, numbered by the session's temp dirs)."""
    return client.models.list().data[0].id


def completion(client: openai.OpenAI, prompt: Any, **fields: Any) -> Any:
    body = {**GREEDY, **fields, "extra_body": {**GREEDY["extra_body"], **fields.get("extra_body", {})}}
    return client.completions.create(model=served(client), prompt=prompt, **body)


def streamed(client: openai.OpenAI, prompt: Any, **fields: Any) -> list[Any]:
    return [chunk.choices[0] for chunk in completion(client, prompt, stream=True, **fields) if chunk.choices]


def assert_prompt_logprobs(entries: list[Any], oracle: torch.Tensor, top: int) -> None:
    assert len(entries) == len(PROMPT_IDS) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        token, row = PROMPT_IDS[position], oracle[position - 1]
        assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        ranks = {int(token_id): value["rank"] for token_id, value in entry.items() if int(token_id) != token}
        best = row.topk(top).indices.tolist()
        assert all(ranks[token_id] == rank for rank, token_id in enumerate(best, start=1) if token_id != token)


def test_prompt_logprobs_in_completions_and_chat_match_transformers(client: openai.OpenAI,
                                                                    oracle: torch.Tensor) -> None:
    answer = completion(client, PROMPT_IDS, extra_body={"prompt_logprobs": 2})
    assert_prompt_logprobs(answer.choices[0].model_extra["prompt_logprobs"], oracle, top=2)
    plain = completion(client, PROMPT_IDS)
    assert "prompt_logprobs" not in plain.choices[0].model_extra  # only when asked
    assert answer.choices[0].text == plain.choices[0].text
    chat = client.chat.completions.create(model=served(client), messages=[{"role": "user", "content": "hi there"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(entry) == 1 for entry in entries[1:])  # the prompt token's own, no top


def test_prompt_logprobs_are_not_streamed(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        streamed(client, PROMPT_IDS, extra_body={"prompt_logprobs": 1})


def test_echo_with_a_batch_of_prompts_is_refused_as_without_it(client: openai.OpenAI) -> None:
    """A batch of prompts is refused (400) before `echo` reads the one prompt, which would fail (a 500)."""
    for echo in (False, True):
        with pytest.raises(openai.BadRequestError, match="batched prompts are not supported"):
            client.completions.create(model=served(client), prompt=["a", "", "b"], max_tokens=2, echo=echo)


def test_echo_returns_the_prompt_first_whole_and_streamed(client: openai.OpenAI, tiny: LiveGateway) -> None:
    plain = completion(client, "Hello world").choices[0]
    echoed = completion(client, "Hello world", echo=True).choices[0]
    assert echoed.text == "Hello world" + plain.text
    chunks = streamed(client, "Hello world", echo=True)
    assert chunks[0].text.startswith("Hello world") and "".join(c.text for c in chunks) == echoed.text
    decoded = tiny.service.tokenizer.decode(PROMPT_IDS, skip_special_tokens=False)
    assert completion(client, PROMPT_IDS, echo=True).choices[0].text.startswith(decoded)
    alone = completion(client, "Hello world", echo=True, max_tokens=0).choices[0]
    assert alone.text == "Hello world"  # vLLM's echo without generation
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        completion(client, "Hello world", max_tokens=0)


def test_echo_with_logprobs_puts_the_prompts_first(client: openai.OpenAI, oracle: torch.Tensor) -> None:
    plain = completion(client, PROMPT_IDS, logprobs=2).choices[0].logprobs
    echoed = completion(client, PROMPT_IDS, logprobs=2, echo=True).choices[0]
    logprobs, count = echoed.logprobs, len(PROMPT_IDS)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1:count] == pytest.approx(
        [float(oracle[p - 1, PROMPT_IDS[p]]) for p in range(1, count)], abs=1e-4)
    assert logprobs.tokens[count:] == plain.tokens
    assert logprobs.token_logprobs[count:] == pytest.approx(plain.token_logprobs, abs=1e-4)
    offsets, tokens = logprobs.text_offset, logprobs.tokens
    assert offsets == [sum(len(token) for token in tokens[:i]) for i in range(len(tokens))]  # vLLM's, from 0
    chunks = streamed(client, PROMPT_IDS, logprobs=2, echo=True)
    assert [token for c in chunks for token in c.logprobs.tokens] == tokens
    assert [value for c in chunks for value in c.logprobs.token_logprobs] == pytest.approx(
        logprobs.token_logprobs, abs=1e-4)
    # A stream's offsets say where each chunk's text starts in the streamed text (the prompt's included).
    assert chunks[1].logprobs.text_offset[0] == len(chunks[0].text)


def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI) -> None:
    free = completion(client, PROMPT_IDS, max_tokens=16).choices[0].text
    stop = next(free[i:i + 2] for i in range(len(free) // 2, len(free) - 1) if free[i:i + 2].strip())
    kept = free[:free.index(stop) + len(stop)]
    assert completion(client, PROMPT_IDS, max_tokens=16, stop=[stop]).choices[0].text == free[:free.index(stop)]
    include = {"include_stop_str_in_output": True}
    answer = completion(client, PROMPT_IDS, max_tokens=16, stop=[stop], extra_body=include).choices[0]
    assert (answer.text, answer.finish_reason) == (kept, "stop")
    chunks = streamed(client, PROMPT_IDS, max_tokens=16, stop=[stop], extra_body=include)
    assert "".join(c.text for c in chunks) == kept
    hi = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=served(client), messages=hi, temperature=0,
                                          max_tokens=16, extra_body={"ignore_eos": True})
    content = chat.choices[0].message.content or ""
    chat_stop = next((content[i:i + 2] for i in range(len(content) - 1) if content[i:i + 2].strip()), None)
    if chat_stop is not None:
        kept_chat = content[:content.index(chat_stop) + len(chat_stop)]
        with_stop = client.chat.completions.create(
            model=served(client), messages=hi, temperature=0, max_tokens=16, stop=[chat_stop],
            extra_body={"ignore_eos": True, **include})
        assert with_stop.choices[0].message.content == kept_chat


def test_skip_special_tokens_false_keeps_their_text(client: openai.OpenAI, tiny: LiveGateway) -> None:
    (eos,) = tiny.service.tokenizer.eos_token_ids
    forced = {"max_tokens": 2, "logit_bias": {str(eos): 100}}
    special = tiny.service.tokenizer.decode([eos], skip_special_tokens=False)
    assert completion(client, "Hello", **forced).choices[0].text == ""
    kept = completion(client, "Hello", **forced, extra_body={"skip_special_tokens": False}).choices[0]
    assert kept.text == special * 2
