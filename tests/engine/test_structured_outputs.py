"""Structured outputs through the whole engine, on a tiny random-weight model.

A random model's free text is noise, so every output that parses (JSON matching its schema, a regex
match, one of the choices) is the grammar's doing. Sampling is random (temperature 1, seeded and
not) as well as greedy: a grammar must hold on any path, not on the argmax alone.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

from cluster.cli import main
from cluster.common.events import FinishReason
from cluster.common.sampling_params import SamplingParams
from cluster.common.structured_output import StructuredOutput
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine, RequestOutput
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from tests.engine.test_engine_outputs import PROMPTS, assert_pool_whole
from tests.helpers import fp32_model, until_idle

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
CHOICES = ["Paris", "Rome", "Madrid", "Lisbon"]
TUPLE_LARK = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'


def valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


FORMS: dict[str, tuple[StructuredOutput, Callable[[str], bool]]] = {
    "json": (StructuredOutput("json", json.dumps(SCHEMA)), valid_json),
    "json_object": (StructuredOutput("json_object"), json_object),
    "regex": (StructuredOutput("regex", "[a-z]{2,6}-[0-9]{2}"), lambda text: re.fullmatch("[a-z]{2,6}-[0-9]{2}", text)
              is not None),
    "choice": (StructuredOutput.of_choices(CHOICES), lambda text: text in CHOICES),
    "grammar": (StructuredOutput("grammar", TUPLE_LARK), lambda text: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)",
                                                                                    text) is not None),
}
SAMPLING = {"greedy": SamplingParams(max_tokens=400, temperature=0),
            "random": SamplingParams(max_tokens=400, temperature=1.0),
            "seeded": SamplingParams(max_tokens=400, temperature=1.0, seed=7)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


def make_engine(path: Path, num_blocks: int = 512, budget: int = 2048) -> LLMEngine:
    return LLMEngine(EngineConfig(model=fp32_model(path),
                                  cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> LLMEngine:
    return make_engine(checkpoint)


def constrained(params: SamplingParams, form: str, **changes: object) -> SamplingParams:
    return dataclasses.replace(params, structured=FORMS[form][0], **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("form", [form for form in FORMS if form != "json_object"])
def test_outputs_follow_their_grammar_and_stop_where_it_ends(engine: LLMEngine, form: str, sampling: str) -> None:
    outputs = engine.generate(PROMPTS, constrained(SAMPLING[sampling], form))
    check = FORMS[form][1]
    assert [(output.text, output.finish_reason) for output in outputs if not check(output.text)] == []
    assert all(output.finish_reason == FinishReason.STOP for output in outputs)
    assert_pool_whole(engine)


def test_any_json_object_is_an_object_when_it_ends(engine: LLMEngine) -> None:
    """Free-form values let a random model write strings for ever: the objects that end must parse,
    those cut by max_tokens must at least have started as one."""
    outputs = engine.generate(PROMPTS * 4, constrained(SAMPLING["random"], "json_object", max_tokens=300))
    ended = [output.text for output in outputs if output.finish_reason == FinishReason.STOP]
    assert ended and all(json_object(text) for text in ended)
    assert all(output.text.startswith("{") for output in outputs)


def test_free_requests_sample_as_they_would_without_constrained_ones_beside_them(engine: LLMEngine) -> None:
    free = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)]
    alone = [engine.generate(PROMPTS, params) for params in free]
    requests = {}
    for index, prompt in enumerate(PROMPTS):
        for kind, params in enumerate(free):
            requests[(kind, index)] = engine.add_request(prompt, params)
        engine.add_request(prompt, constrained(SAMPLING["random"], list(FORMS)[index % len(FORMS)]))
    finished = drain(engine)
    for (kind, index), request in requests.items():
        assert finished[request.request_id].token_ids == alone[kind][index].token_ids


def test_a_resumed_run_goes_on_in_its_grammar_as_one_run(engine: LLMEngine) -> None:
    """A run resumed elsewhere gets its prompt plus the tokens already out, `seed_offset` of them: its
    grammar replays them, so a seeded run gives what the uninterrupted run gave."""
    params = constrained(SAMPLING["seeded"], "json")
    whole = engine.generate([PROMPTS[1]], params)[0].token_ids
    for cut in (1, 5, len(whole) // 2):
        resumed = dataclasses.replace(params, max_tokens=params.max_tokens - cut, seed_offset=cut)
        rest = engine.generate([PROMPTS[1] + whole[:cut]], resumed)[0]
        assert whole[:cut] + rest.token_ids == whole, cut
        assert valid_json(engine.tokenizer.decode(whole[:cut] + rest.token_ids))


def test_a_resumed_run_whose_earlier_tokens_break_the_grammar_is_refused(engine: LLMEngine) -> None:
    params = constrained(SAMPLING["greedy"], "choice", seed_offset=2)
    garbage = engine.tokenizer.encode("xyz", add_special_tokens=False)[:2]
    with pytest.raises(ValueError, match="does not follow its grammar"):
        engine.add_request(PROMPTS[0] + garbage, params)
    finished = engine.tokenizer.encode("Rome", add_special_tokens=False)
    with pytest.raises(ValueError, match="already completes its grammar"):
        engine.add_request(PROMPTS[0] + finished, dataclasses.replace(params, seed_offset=len(finished)))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("structured", [
    StructuredOutput("json", '{"type": "nonsense"}'), StructuredOutput("regex", "[a-"),
    StructuredOutput("grammar", "start: nothing")])
def test_a_spec_that_does_not_compile_is_refused_before_it_queues(engine: LLMEngine,
                                                                   structured: StructuredOutput) -> None:
    with pytest.raises(ValueError, match="invalid"):
        engine.add_request(PROMPTS[0], SamplingParams(structured=structured))
    assert not engine.has_unfinished_requests()
    assert_pool_whole(engine)


def test_a_complete_grammar_ends_the_request_whatever_min_tokens_or_ignore_eos_say(engine: LLMEngine) -> None:
    params = constrained(SAMPLING["random"], "choice", min_tokens=50, ignore_eos=True)
    outputs = engine.generate(PROMPTS, params)
    assert all(output.text in CHOICES and output.finish_reason == FinishReason.STOP for output in outputs)


def test_preempted_requests_keep_their_grammar(checkpoint: Path) -> None:
    """An undersized pool preempts and recomputes requests mid-output: greedy outputs stay the same."""
    params = constrained(SAMPLING["greedy"], "json")
    expected = [output.token_ids for output in make_engine(checkpoint).generate(PROMPTS, params)]
    small = make_engine(checkpoint, num_blocks=100, budget=16)  # room for one or two of them at a time
    assert [output.token_ids for output in small.generate(PROMPTS, params)] == expected
    assert small.scheduler.num_preemptions > 0
    assert_pool_whole(small)


# ---- disaggregated: the prefill worker samples the first token, the decode worker the rest --------


def prefill_first_token(prefill: LLMEngine, prompt: list[int], request_id: str, params: SamplingParams) -> int:
    """The prefill worker's part, with the parameters `Worker.prefill` gives it."""
    first_params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), ignore_eos=True)
    prefill.add_prefill(prompt, first_params, request_id=request_id)
    for _ in until_idle(prefill):
        outputs = prefill.step()
    (output,) = outputs
    return output.token_ids[0]


def hand_over(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], request_id: str,
              params: SamplingParams, first_token_id: int | None = None) -> RequestOutput:
    assert decode.reserve_remote(prompt, params, request_id=request_id) is not None
    first = prefill_first_token(prefill, prompt, request_id, params)
    decode.import_kv(request_id, prefill.export_kv(request_id).data.clone())
    prefill.release_held(request_id)
    return decode.admit_remote(request_id, first if first_token_id is None else first_token_id)


def test_the_prefill_workers_first_token_obeys_the_grammar_and_the_decode_worker_goes_on(checkpoint: Path) -> None:
    """Seeded: the disaggregated run gives exactly what one engine gives, the grammar included."""
    alone = make_engine(checkpoint)
    prefill, decode = make_engine(checkpoint, budget=7), make_engine(checkpoint)
    for form in ("json", "regex", "grammar"):
        params = constrained(SAMPLING["seeded"], form)
        expected = [output.token_ids for output in alone.generate(PROMPTS, params)]
        for index, prompt in enumerate(PROMPTS):
            hand_over(prefill, decode, prompt, f"{form}-{index}", params)
        finished = drain(decode)
        assert [finished[f"{form}-{index}"].token_ids for index in range(len(PROMPTS))] == expected
        assert all(FORMS[form][1](finished[f"{form}-{index}"].text) for index in range(len(PROMPTS)))
    assert_pool_whole(prefill)
    assert_pool_whole(decode)


def test_a_first_token_the_grammar_refuses_ends_the_request_with_an_error(checkpoint: Path) -> None:
    """A prefill worker that sampled outside the grammar (a version without it): the decode worker
    does not go on with an output that can no longer follow it."""
    prefill, decode = make_engine(checkpoint), make_engine(checkpoint)
    stray = decode.tokenizer.encode("x", add_special_tokens=False)[0]
    output = hand_over(prefill, decode, PROMPTS[0], "stray", constrained(SAMPLING["greedy"], "json"), stray)
    assert output.finished and output.finish_reason == FinishReason.ERROR
    assert not decode.has_unfinished_requests()
    assert_pool_whole(decode)


def drain(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished = {}
    for _ in until_idle(engine):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_the_cli_asks_for_one_form(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["generate", "hello", "--raw", "--model", str(checkpoint), "--temperature", "1", "--max-tokens", "50"]
    assert main([*common, "--choice", "yes", "--choice", "no"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main([*common, "--max-tokens", "400", "--json-schema", f"@{schema}"]) == 0
    assert valid_json(capsys.readouterr().out.strip())
    assert main([*common, "--regex", "a+", "--choice", "b"]) == 2
    assert "one structured output at most" in capsys.readouterr().err
