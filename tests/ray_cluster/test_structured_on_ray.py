"""Structured outputs and tool calling through the official `openai` client, on the disaggregated Ray
cluster (1 prefill + 1 decode worker): the prefill worker samples the first token under the grammar,
the decode worker goes on in the same grammar state, and a request resumed after its decode worker
died goes on in it too. Unseeded sampling at temperature 1: a random model follows the form only
because the grammar holds it to it."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from cluster.common.sampling_params import SamplingParams
from cluster.engine.llm_engine import LLMEngine
from cluster.ray_cluster.config import ClusterConfig, PoolConfig
from cluster.ray_cluster.launcher import Cluster
from cluster.serving.cluster_service import ClusterService
from cluster.serving.http.gateway import HttpServer, build_app
from tests.helpers import fp32_engine
from tests.ray_cluster.conftest import pace_steps
from tests.ray_cluster.test_ray_cluster import assert_pools_whole
from tests.serving.http.test_tool_calling import MODEL, build_hermes_checkpoint, stream

pytestmark = pytest.mark.usefixtures("ray_session")
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TRIP_TOOL = {"type": "function", "function": {"name": "plan_trip", "description": "Plan a trip",
                                              "parameters": SCHEMA}}
ASK = [{"role": "user", "content": "Plan a trip."}]


@pytest.fixture(scope="module")
def hermes_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hermes_checkpoint(tmp_path_factory.mktemp("ray-hermes") / MODEL)


@pytest.fixture(scope="module")
def cluster(hermes_checkpoint: Path) -> Iterator[Cluster]:
    engine = fp32_engine(hermes_checkpoint, block_size=16, num_blocks=256)
    config = ClusterConfig(prefill=PoolConfig(replicas=1, num_cpus=0.1), decode=PoolConfig(replicas=1, num_cpus=0.1),
                           engine=engine)
    started = Cluster(config).start()
    yield started
    started.stop()


class Gateway:
    """The HTTP gateway in front of the cluster, on a loop in a thread of its own (the client blocks)."""

    def __init__(self, cluster: Cluster) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = HttpServer(build_app(ClusterService(cluster), api_key=""), "127.0.0.1", 0)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(60)
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="unused", max_retries=0, timeout=180)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def gateway(cluster: Cluster) -> Iterator[Gateway]:
    started = Gateway(cluster)
    yield started
    started.close()


def test_json_schema_regex_and_choice_answers_follow_their_form(gateway: Gateway, cluster: Cluster) -> None:
    client = gateway.client
    for _ in range(3):
        answer = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=200, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}})
        jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)
    regex = r"[A-Z][a-z]{2,6} \d{2}"
    text = client.completions.create(model=MODEL, prompt="Where?", max_tokens=20, temperature=1.0,
                                     extra_body={"guided_regex": regex}).choices[0].text
    assert re.fullmatch(regex, text), text
    choice = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=1.0,
                                       extra_body={"guided_choice": ["north", "south", "east"]}).choices[0].text
    assert choice in ("north", "south", "east")
    assert_pools_whole(cluster)


def test_a_named_tool_call_and_its_streamed_deltas_parse_and_validate(gateway: Gateway) -> None:
    named = {"type": "function", "function": {"name": "plan_trip"}}
    answer = gateway.client.chat.completions.create(model=MODEL, messages=ASK, tools=[TRIP_TOOL], tool_choice=named,
                                                    max_tokens=200, temperature=1.0)
    (call,) = answer.choices[0].message.tool_calls or []
    assert call.function.name == "plan_trip" and answer.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    chunks, final = stream(gateway.client, messages=ASK, tools=[TRIP_TOOL], tool_choice=named, max_tokens=200,
                           temperature=1.0)
    (streamed,) = final.choices[0].message.tool_calls or []
    pieces = "".join(tool.function.arguments or "" for chunk in chunks for choice in chunk.choices
                     for tool in choice.delta.tool_calls or [] if tool.function)
    assert streamed.function.name == "plan_trip" and streamed.function.arguments == pieces
    jsonschema.validate(json.loads(pieces), SCHEMA)


def test_unconstrained_requests_batched_with_constrained_ones_give_their_tokens_alone(
        gateway: Gateway, cluster: Cluster, hermes_checkpoint: Path) -> None:
    prompts = ["one two", "three four five", "six"]
    engine = LLMEngine(fp32_engine(hermes_checkpoint, block_size=16, num_blocks=256))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [output.text for output in engine.generate(prompts, greedy)]

    def constrained() -> str:
        return gateway.client.completions.create(model=MODEL, prompt="x", max_tokens=200, temperature=1.0,
                                                 extra_body={"guided_json": SCHEMA}).choices[0].text

    def plain(prompt: str) -> str:
        return gateway.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].text

    async def together() -> list[str]:
        jobs = [asyncio.to_thread(constrained) for _ in range(3)] + [asyncio.to_thread(plain, p) for p in prompts]
        return list(await asyncio.gather(*jobs))

    answers = asyncio.run(together())
    for text in answers[:3]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert answers[3:] == alone
    assert_pools_whole(cluster)


def test_a_constrained_stream_resumed_after_its_decode_worker_died_keeps_its_grammar(gateway: Gateway,
                                                                                     cluster: Cluster) -> None:
    """The only decode worker is killed mid-answer: the request waits for it to restart and goes on
    from the text already sent, in the grammar state that text left (replayed), so the whole answer
    still follows the schema."""
    import ray

    long_text = {"type": "object", "properties": {"note": {"type": "string", "minLength": 60, "maxLength": 80}},
                 "required": ["note"], "additionalProperties": False}
    ray.get(cluster.decode[0].__ray_call__.remote(pace_steps(0.03)), timeout=30)
    chunks: list[Any] = []
    stream_of = gateway.client.completions.create(model=MODEL, prompt="Note:", max_tokens=300, temperature=1.0,
                                                  stream=True, extra_body={"guided_json": long_text})
    killed = False
    for chunk in stream_of:
        chunks.append(chunk)
        if len(chunks) == 10 and not killed:
            ray.kill(cluster.decode[0], no_restart=False)  # a crash: Ray starts it again
            killed = True
    text = "".join(choice.text for chunk in chunks for choice in chunk.choices)
    jsonschema.validate(json.loads(text), long_text)
    assert killed and ray.get(cluster.router.stats.remote(), timeout=30)["resumed"] >= 1
    deadline = time.monotonic() + 60
    while True:
        try:
            assert_pools_whole(cluster)
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.5)


def test_logit_bias_and_priority_on_the_cluster_path(gateway: Gateway, cluster: Cluster) -> None:
    """logit_bias steers the prefill worker's first token and the decode worker's after it; a
    priority the workers' scheduler does not run (fcfs) is a 400 naming why, not a 500."""
    answer = gateway.client.completions.create(model=MODEL, prompt="one two", max_tokens=6, temperature=0,
                                               logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    assert answer.usage is not None and answer.usage.completion_tokens == 6
    tokens = cluster.tokenizer.encode(answer.choices[0].text, add_special_tokens=False)  # type: ignore[union-attr]
    assert tokens == [77] * 6
    with pytest.raises(openai.BadRequestError, match="priority scheduling is not enabled"):
        gateway.client.completions.create(model=MODEL, prompt="one", max_tokens=2, extra_body={"priority": 1})
    assert_pools_whole(cluster)
