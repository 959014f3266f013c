"""Overload and cancellation at the gateway, on a tiny model whose engine steps are paced: a pause
before each step (`conftest.paced`) keeps admitted requests running long enough that the checks
can be about the order of events rather than wall-clock time.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cluster.bench.soak import rss_bytes
from cluster.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from cluster.engine.llm_engine import LLMEngine
from cluster.serving.local_service import LocalService
from tests.helpers import fp32_model
from tests.serving.http.conftest import Gateways, engine_idle, paced, wait_until

MAX_RSS_GROWTH = 100 << 20  # generous: the burst itself needs a few MiB


def roomy_config(checkpoint: Path, **scheduler: Any) -> EngineConfig:
    """Room in the KV pool for everything these tests run at once (2,000 tokens): no preemption."""
    return EngineConfig(model=fp32_model(checkpoint), cache=CacheConfig(block_size=4, num_blocks=600),
                        scheduler=SchedulerConfig(**scheduler))


def assert_engine_whole(service: LocalService) -> None:
    assert wait_until(lambda: engine_idle(service))
    engine = service.engine
    assert not engine.detokenizers and not engine.kv_cache.blocks_of and not service.worker.streams


# ---- a burst of ten times what the service holds ---------------------------------------------------


@dataclass
class Answer:
    status: int
    done_at: float  # when the whole answer had arrived
    retry_after: str | None = None
    tokens: int = 0
    finish_reason: str | None = None


async def ask(client: httpx.AsyncClient, body: dict[str, Any]) -> Answer:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            error = json.loads(await response.aread())["error"]
            assert error["code"] == "rate_limit_exceeded" and error["message"]
            return Answer(response.status_code, time.monotonic(), response.headers.get("retry-after"))
        if not body["stream"]:
            answer = json.loads(await response.aread())
            return Answer(200, time.monotonic(), tokens=answer["usage"]["completion_tokens"],
                          finish_reason=answer["choices"][0]["finish_reason"])
        events = [line.removeprefix("data: ") async for line in response.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event) for event in events[:-1]]
        reasons = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]]
        return Answer(200, time.monotonic(), tokens=chunks[-1]["usage"]["completion_tokens"],
                      finish_reason=[reason for reason in reasons if reason][-1])


def test_a_burst_of_ten_times_capacity_is_refused_at_once_and_the_admitted_finish(
        gateways: Gateways, tiny_checkpoint: Path) -> None:
    max_num_seqs, max_waiting = 2, 2
    capacity = max_num_seqs + max_waiting
    service = gateways.start_service(roomy_config(tiny_checkpoint, max_num_seqs=max_num_seqs,
                                                  max_waiting_requests=max_waiting))
    live = gateways.serve(service)
    paced(service)
    max_tokens = 150  # 150 paced steps: far longer than answering the refusals takes

    async def burst(size: int, max_tokens: int) -> list[Answer]:
        body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        limits = httpx.Limits(max_connections=size)
        async with httpx.AsyncClient(base_url=live.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(ask(client, {**body, "stream": i % 2 == 1}) for i in range(size)))

    asyncio.run(burst(2, max_tokens=2))  # warm up what the first requests allocate
    rss_before = rss_bytes()
    answers = asyncio.run(burst(10 * capacity, max_tokens))

    admitted = [answer for answer in answers if answer.status == 200]
    refused = [answer for answer in answers if answer.status != 200]
    # The queue refuses once `max_waiting` wait; how many ran before it filled depends on the steps
    # taken meanwhile, never more than the running slots (no admitted request ends that soon).
    assert max_waiting <= len(admitted) <= capacity
    assert {answer.status for answer in refused} == {429}
    assert all(answer.retry_after == "1" for answer in refused)
    assert max(answer.done_at for answer in refused) < min(answer.done_at for answer in admitted)
    assert all((answer.tokens, answer.finish_reason) == (max_tokens, "length") for answer in admitted)
    assert_engine_whole(service)
    growth = rss_bytes() - rss_before
    assert growth < MAX_RSS_GROWTH, f"RSS grew by {growth >> 20} MiB"


# ---- many clients leaving at once, wherever their requests are -------------------------------------


def test_many_cancellations_at_once_free_every_block_before_any_could_finish(
        gateways: Gateways, tiny_checkpoint: Path) -> None:
    """Five requests run (four decoding, one with a long prompt still prefilling, at most 8 tokens
    a step) and five wait; all ten clients leave at once. The engine is empty before the prompt
    could have finished, and then serves the next request as usual."""
    budget = 8
    service = gateways.start_service(roomy_config(tiny_checkpoint, max_num_seqs=5, max_num_batched_tokens=budget))
    live = gateways.serve(service)
    steps = paced(service)
    engine = service.engine
    decode = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    prefill = {"prompt": [10 + i % 300 for i in range(400)], "max_tokens": 100, "ignore_eos": True}

    async def first_chunk_then_wait(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/completions", json=decode) as response:
            async for _ in response.aiter_lines():
                await asyncio.Event().wait()  # holds the stream open until cancelled

    async def leave_together() -> tuple[dict[str, list[Any]], int]:
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as client:
            tasks = [asyncio.create_task(first_chunk_then_wait(client)) for _ in range(4)]
            await until(lambda: sum(r.num_output_tokens > 0 for r in engine.scheduler.running) == 4)
            tasks += [asyncio.create_task(client.post("/v1/completions", json={**prefill, "stream": i % 2 == 0}))
                      for i in range(6)]
            await until(lambda: len(snapshot(engine)["waiting"]) == 5)
            state = snapshot(engine)
            for task in tasks:
                task.cancel()
            cancelled_at_step = steps.count
            await asyncio.gather(*tasks, return_exceptions=True)
            assert all(task.cancelled() for task in tasks)  # none had ended by itself
            return state, cancelled_at_step

    state, cancelled_at_step = asyncio.run(leave_together())
    assert len(state["running"]) == 5 and len(state["prefilling"]) == 1 and len(state["waiting"]) == 5
    assert wait_until(lambda: engine_idle(service))
    steps_after = steps.count - cancelled_at_step
    fewest_left = min(request.num_prompt_tokens - computed for request, computed in state["prefilling"])
    assert steps_after < fewest_left // budget, f"{steps_after} steps to free the blocks"
    assert_engine_whole(service)
    with httpx.Client(base_url=live.url, timeout=60) as client:
        response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert response.json()["usage"]["completion_tokens"] == 3


def snapshot(engine: LLMEngine) -> dict[str, list[Any]]:
    """The engine's queues as seen from another thread (a consistent enough read for a test)."""
    running = list(engine.scheduler.running)
    return {"running": running, "waiting": list(engine.scheduler.waiting),
            "prefilling": [(r, r.num_computed_tokens) for r in running if r.num_computed_tokens < r.num_prompt_tokens]}


async def until(condition: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the engine never reached the state the test needs"
        await asyncio.sleep(0.01)
