"""`StructuredOutput`'s shape checks, and `SamplingParams` carrying one across processes."""

from __future__ import annotations

import pickle

import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.common.structured_output import StructuredOutput


@pytest.mark.parametrize("structured", [
    StructuredOutput("json", '{"type": "object"}'), StructuredOutput("json_object"),
    StructuredOutput("regex", "[a-z]+"), StructuredOutput.of_choices(["yes", "no"]),
    StructuredOutput("grammar", 'start: "a"+'),
])
def test_sampling_params_with_a_structured_output_stay_hashable_and_picklable(structured: StructuredOutput) -> None:
    params = SamplingParams(max_tokens=8, structured=structured)
    copy = pickle.loads(pickle.dumps(params))
    assert copy == params and hash(copy) == hash(params) and copy.structured == structured
    assert {params: 1}[SamplingParams(max_tokens=8, structured=StructuredOutput(structured.kind, structured.spec))]


@pytest.mark.parametrize(("kind", "spec", "message"), [
    ("yaml", "a: 1", "kind must be one of"),
    ("json", "", "needs a spec"),
    ("regex", "  ", "needs a spec"),
    ("grammar", "", "needs a spec"),
    ("json_object", "{}", "takes no spec"),
    ("choice", "[]", "non-empty JSON list of strings"),
    ("choice", '["a", 1]', "non-empty JSON list of strings"),
    ("choice", '{"a": 1}', "non-empty JSON list of strings"),
    ("choice", "[a", "JSON list of strings"),
])
def test_malformed_structured_outputs_are_refused(kind: str, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutput(kind, spec)


def test_choices_round_trip_through_the_spec() -> None:
    choices = ['say "hi"', "café", "a | b"]
    assert StructuredOutput.of_choices(choices).choices() == choices


def test_sampling_params_refuse_another_type_as_structured() -> None:
    with pytest.raises(ValueError, match="StructuredOutput"):
        SamplingParams(structured={"kind": "regex", "spec": "a"})  # type: ignore[arg-type]
