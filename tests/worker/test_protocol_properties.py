"""A stateful property test of the disaggregated protocol: one prefill and one decode worker joined
by the loopback connector, several requests at once, every way a request can go.

Hypothesis's `RuleBasedStateMachine` drives it. Its rules are plain functions, and the workers need
one asyncio loop that lives across rules (a prefill started by one rule sends its frames while later
rules run), so the machine owns an event loop and each rule runs one coroutine to completion on it
(`_run`). Tasks started by a rule (a prefill being consumed, a decode stream being read) go on in
whatever loop time later rules give them, while the engine threads step on their own: the
interleavings come both from the rule order hypothesis draws and from real concurrency. The
stateful API (rather than a drawn list of operations run in one loop) is kept for its shrinking,
which deletes whole rules and prints the failing program as steps.

Each request is driven as the router drives it (`serve` in test_worker_disaggregated.py): reserve on
the decode worker (short or long lease), prefill on the prefill worker with the ticket (its budget
of 6 tokens chunks the prompts into several steps and frames), on TransferError a recompute on the
decode worker with the first token it streamed, then stream from the decode worker. The rules
interleave these on up to MAX_REQUESTS requests with injected transfer failures (every FailMode),
aborts from either side at any point, consumers that stop reading (the prefill's or the decode's
async generator closed early), and time passing. After every rule the invariants that hold at any
time are checked (`_check_any_time`); at the end the machine does what a router does to finish
every request, waits for both engines to go idle and checks that everything is back to zero
(`_check_drained`), and that every request ended with its tokens or an explicit abort.

Requests are picked by a drawn index taken modulo the requests a rule applies to (`_flow`): which
ones qualify depends on timing, and draws that depend on timing make hypothesis's replays
inconsistent. A failure that depends on timing may still not replay exactly; every await is
bounded (AWAIT_S), so a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cluster.common.events import FinishReason
from cluster.common.loads import KVTicket, TransferStats
from cluster.common.sampling_params import SamplingParams
from cluster.engine.config import CacheConfig, EngineConfig
from cluster.engine.llm_engine import LLMEngine, RequestOutput
from cluster.transfer.connector import TransferError
from cluster.transfer.loopback import FailMode, LoopbackHub, LoopbackReceiver, LoopbackSender
from cluster.weights.synthetic import build_tiny_llama_checkpoint
from cluster.worker.worker import Worker
from tests.engine.test_engine_outputs import PROMPTS
from tests.helpers import fp32_model
from tests.worker.test_worker_disaggregated import make_engine

MAX_REQUESTS = 6
MAX_TOKENS = 8
SHORT_LEASE_S = 0.05  # ends before a chunked prefill can deliver: the decode worker computes the prompt
LONG_LEASE_S = 30.0  # never ends within a run: only the KV or a recompute moves the request on
WHICH = st.integers(0, MAX_REQUESTS - 1)
AWAIT_S = 20.0  # the bound on every await: past it, the request hangs and the test fails


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny"))


@dataclass
class Flow:
    """One request as the router sees it."""

    request_id: str
    prompt: int  # index into PROMPTS
    max_tokens: int
    ticket: KVTicket | None = None
    prefill: asyncio.Task[None] | None = None
    prefill_tokens: list[int] = field(default_factory=list)
    prefill_outcome: str = ""  # "sent", "transfer_error", "aborted", "closed"
    recomputed: bool = False
    stream: asyncio.Task[None] | None = None
    tokens: list[int] = field(default_factory=list)  # the decode worker's cumulative token_ids
    outcome: str = ""  # "finished", "aborted", "closed"
    aborted: bool = False  # an abort rule hit it (on one side)
    finish_reason: str | None = None


class ProtocolMachine(RuleBasedStateMachine):
    checkpoint: ClassVar[Path]
    expected: ClassVar[list[list[int]]]

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.hub = LoopbackHub()
        self.prefill = Worker("prefill-0", "prefill", make_engine(self.checkpoint, budget=6),
                              sender=LoopbackSender(self.hub, timeout_s=AWAIT_S))
        # A small pool: a few long prompts fill it, so reservations are refused too (None).
        self.decode = Worker("decode-0", "decode", _engine(self.checkpoint, num_blocks=40),
                             receiver=LoopbackReceiver(self.hub, "decode-0"))
        self.flows: list[Flow] = []
        self.started = False

    # ---- the loop ------------------------------------------------------------------------------

    def _run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, AWAIT_S))

    @initialize()
    def start(self) -> None:
        self._run(self.prefill.start())
        self._run(self.decode.start())
        self.started = True

    def teardown(self) -> None:
        try:
            if self.started:
                self._run(self._drain())
        finally:
            try:
                for flow in self.flows:
                    for task in (flow.prefill, flow.stream):
                        if task is not None and not task.done():
                            task.cancel()
                self._run(self.prefill.stop())
                self._run(self.decode.stop())
                self.loop.run_until_complete(asyncio.sleep(0))
            finally:
                self.loop.close()

    # ---- the router's part ---------------------------------------------------------------------

    async def _consume_prefill(self, flow: Flow, close_after: int | None) -> None:
        assert flow.ticket is not None
        items = cast(AsyncGenerator[RequestOutput | TransferStats, None], self.prefill.prefill(
            flow.request_id, PROMPTS[flow.prompt], greedy(flow.max_tokens), flow.ticket))
        read = 0
        try:
            async for item in items:
                if isinstance(item, TransferStats):
                    flow.prefill_outcome = "sent"
                    continue
                flow.prefill_tokens += item.new_token_ids
                if item.finish_reason == FinishReason.ABORT:
                    flow.prefill_outcome = "aborted"
                read += 1
                if close_after is not None and read >= close_after:
                    flow.prefill_outcome = "closed"  # the router stopped reading: no stats, no error
                    break
        except TransferError:
            flow.prefill_outcome = "transfer_error"
        finally:
            await items.aclose()
        flow.prefill_outcome = flow.prefill_outcome or "aborted"

    async def _consume_stream(self, flow: Flow, close_after: int | None) -> None:
        # As the router: the first token the client has from the prefill, if any yet.
        first_token_id = flow.prefill_tokens[0] if flow.prefill_tokens else None
        outputs = cast(AsyncGenerator[RequestOutput, None], self.decode.stream(flow.request_id, first_token_id))
        read = 0
        try:
            async for output in outputs:
                assert output.token_ids[:len(flow.tokens)] == flow.tokens, "a token changed or went missing"
                flow.tokens = list(output.token_ids)
                read += 1
                if output.finished:
                    flow.outcome = "aborted" if output.finish_reason == FinishReason.ABORT else "finished"
                    flow.finish_reason = output.finish_reason
                elif close_after is not None and read >= close_after:
                    flow.outcome = "closed"
                    break
        finally:
            await outputs.aclose()
        assert flow.outcome, f"{flow.request_id}: the stream ended without a last output"

    async def _recompute(self, flow: Flow) -> None:
        flow.recomputed = True
        await self.decode.recompute(flow.request_id, flow.prefill_tokens[0] if flow.prefill_tokens else None)

    # ---- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: len(self.flows) < MAX_REQUESTS)
    @rule(prompt=st.integers(0, len(PROMPTS) - 1), max_tokens=st.integers(1, MAX_TOKENS), short=st.booleans())
    def reserve(self, prompt: int, max_tokens: int, short: bool) -> None:
        flow = Flow(f"r{len(self.flows)}", prompt, max_tokens)
        self.flows.append(flow)
        flow.ticket = self._run(self.decode.reserve(flow.request_id, PROMPTS[prompt], greedy(max_tokens),
                                                    lease_s=SHORT_LEASE_S if short else LONG_LEASE_S))
        if flow.ticket is None:  # the pool is full: nothing of it may stay
            assert flow.request_id not in self.decode.streams

    def _flow(self, which: int, condition: Any) -> Flow | None:
        """The `which`-th request (cyclically) that `condition` admits. Drawn as a plain index, not
        with `sampled_from` over the candidates: which requests qualify depends on timing, and a
        draw that depends on it would make hypothesis's replays draw differently (an error)."""
        candidates = [flow for flow in self.flows if flow.ticket is not None and condition(flow)]
        return candidates[which % len(candidates)] if candidates else None

    @rule(which=WHICH, close_after=st.sampled_from([None, None, 1]))
    def start_prefill(self, which: int, close_after: int | None) -> None:
        flow = self._flow(which, lambda flow: flow.prefill is None)
        if flow is not None:
            flow.prefill = self.loop.create_task(self._consume_prefill(flow, close_after))
            self._run(asyncio.sleep(0))

    @rule(mode=st.sampled_from(list(FailMode)))
    def fail_next_send(self, mode: FailMode) -> None:
        self.hub.fail_next(1, mode)

    @rule(which=WHICH)
    def recompute_after_failed_send(self, which: int) -> None:
        """The router's answer to a prefill that ended without sending the KV."""
        flow = self._flow(which, lambda flow: flow.prefill is not None and flow.prefill.done()
                           and flow.prefill_outcome != "sent" and not flow.recomputed)
        if flow is not None:
            self._run(self._recompute(flow))

    @rule(which=WHICH, close_after=st.sampled_from([None, None, 1, 2]))
    def start_stream(self, which: int, close_after: int | None) -> None:
        flow = self._flow(which, lambda flow: flow.stream is None)
        if flow is not None:
            flow.stream = self.loop.create_task(self._consume_stream(flow, close_after))
            self._run(asyncio.sleep(0))

    @rule(which=WHICH, on_decode=st.booleans())
    def abort(self, which: int, on_decode: bool) -> None:
        flow = self._flow(which, lambda flow: True)
        if flow is not None:
            flow.aborted = True
            self._run((self.decode if on_decode else self.prefill).abort(flow.request_id))

    @rule(seconds=st.sampled_from([0.0, 0.01, 0.05, 0.2]))
    def let_time_pass(self, seconds: float) -> None:
        self._run(asyncio.sleep(seconds))

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def check_any_time(self) -> None:
        if self.started:
            self._run(self._check_any_time())

    async def _check_any_time(self) -> None:
        """What must hold at every point, whatever is in flight."""
        flows = {flow.request_id: flow for flow in self.flows}
        ended = {rid for rid, flow in flows.items() if flow.stream is not None and flow.stream.done()}
        prefill_ended = {rid for rid, flow in flows.items() if flow.prefill is not None and flow.prefill.done()}
        for task in [flow.prefill for flow in self.flows] + [flow.stream for flow in self.flows]:
            if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]  # a consumer saw something wrong
        # Once a consumer is done with a request, the worker keeps no queue for it.
        assert not ended & set(self.decode.streams), "decode: a stream entry nobody can read"
        assert not prefill_ended & set(self.prefill.streams), "prefill: a stream entry nobody can read"
        assert not prefill_ended & set(self.prefill.outboxes), "prefill: an outbox of a prefill that ended"
        assert set(self.prefill.streams) <= set(flows) and set(self.decode.streams) <= set(flows)
        assert set(self.prefill.outboxes) <= set(self.prefill.streams)
        prefill, decode = await self.prefill._call(lambda: _snapshot(self.prefill)), \
            await self.decode._call(lambda: _snapshot(self.decode))
        for side in (prefill, decode):
            # No blocks or per-request state outside a request the scheduler knows.
            assert side["owners"] <= side["requests"] | side["held"], side
            assert side["detokenizers"] <= side["requests"], side
            assert not side["miscounted"] and not side["free_but_owned"], side
        # Blocks held for an export are released in the step that finished the prefill.
        assert not prefill["held"] and not prefill["reserved"] and not decode["held"]
        # A request in an engine is one somebody still streams (or whose stream is closing).
        assert not prefill["requests"] & prefill_ended, prefill
        assert not decode["requests"] & ended, decode
        assert decode["reserved"] <= decode["requests"] and decode["remote_ready"] <= decode["requests"]
        assert decode["parked"] <= decode["requests"] - decode["reserved"] and decode["settled"] <= decode["reserved"]

    async def _drain(self) -> None:
        """Finish every request as the router and the server would, let both engines go idle, then
        check that nothing of any request is left anywhere.

        The router always prefills what it reserved, recomputes after a TransferError, and aborts on
        both sides: a request whose client went away (a consumer closed early) and one aborted on
        one side (a router's abort reaches every worker). Then it streams what it has not streamed.
        """
        await self._check_any_time()
        for flow in self.flows:
            if flow.ticket is not None and flow.prefill is None:
                flow.prefill = asyncio.create_task(self._consume_prefill(flow, None))
        await asyncio.wait_for(asyncio.gather(*(flow.prefill for flow in self.flows if flow.prefill)), AWAIT_S)
        for flow in self.flows:
            if flow.ticket is None:
                continue
            if flow.prefill_outcome == "transfer_error" and not flow.recomputed:
                await self._recompute(flow)
            if flow.aborted or "closed" in (flow.prefill_outcome, flow.outcome):
                await self.decode.abort(flow.request_id)
                await self.prefill.abort(flow.request_id)
            if flow.stream is None:
                flow.stream = asyncio.create_task(self._consume_stream(flow, None))
        await asyncio.wait_for(asyncio.gather(*(flow.stream for flow in self.flows if flow.stream is not None)),
                               AWAIT_S)
        for worker in (self.prefill, self.decode):
            for _ in range(200):
                if not await worker._call(worker.engine.has_unfinished_requests):
                    break
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # the last callbacks (a transfer's future, a closed stream's abort)
        await self._check_any_time()
        for flow in self.flows:
            event(f"prefill {flow.prefill_outcome or 'refused'}, stream {flow.outcome or 'none'}"
                  f"{', recomputed' * flow.recomputed}")
        self._check_drained(await self.prefill._call(lambda: _snapshot(self.prefill)),
                            await self.decode._call(lambda: _snapshot(self.decode)))

    def _check_drained(self, prefill: dict[str, Any], decode: dict[str, Any]) -> None:
        for worker, side in ((self.prefill, prefill), (self.decode, decode)):
            name = worker.worker_id
            assert side["free"] == side["num_blocks"], f"{name}: KV blocks leaked: {side}"
            for key in ("requests", "owners", "held", "reserved", "parked", "settled", "remote_ready", "detokenizers",
                        "rows"):
                assert not side[key], f"{name}: {key} left: {side[key]}"
            assert not worker.streams, f"{name}: streams left: {set(worker.streams)}"
            assert not worker.outboxes, f"{name}: outboxes left: {set(worker.outboxes)}"
            assert not worker.pending, f"{name}: calls unanswered: {worker.pending}"
        slots = self.decode.receiver._table._slots  # type: ignore[union-attr]
        assert not slots, f"the receiver still holds buffers for {set(slots)}"
        for flow in self.flows:
            if flow.ticket is None:
                continue
            assert flow.outcome in ("finished", "aborted", "closed"), flow
            expected = self.expected[flow.prompt][:flow.max_tokens]
            # Greedy: whichever worker computed the prompt, the tokens are the engine's own.
            assert flow.prefill_tokens in ([], expected[:1]), flow
            if flow.outcome == "finished":
                assert flow.tokens == expected and flow.finish_reason == FinishReason.LENGTH, (flow, expected)
            else:
                assert flow.tokens == expected[:len(flow.tokens)], (flow, expected)


def _engine(path: Path, num_blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=fp32_model(path),
                                  cache=CacheConfig(block_size=4, num_blocks=num_blocks)))


def _snapshot(worker: Worker) -> dict[str, Any]:
    """The engine's bookkeeping, read on its own thread (between steps)."""
    engine = worker.engine
    scheduler, kv_cache = engine.scheduler, engine.kv_cache
    pool = kv_cache.pool
    owners = collections.Counter(block_id for ids in kv_cache.block_ids_of.values() for block_id in ids)
    return {
        "requests": set(scheduler.requests), "held": set(scheduler.held), "reserved": set(scheduler.reserved),
        "parked": set(scheduler.parked), "settled": set(scheduler.settled),
        "remote_ready": {request.request_id for request in scheduler.remote_ready},
        "owners": set(kv_cache.block_ids_of), "detokenizers": set(engine.detokenizers),
        "rows": set(engine.runner.block_tables.row_of), "free": pool.num_free_blocks, "num_blocks": pool.num_blocks,
        # Each block's owners as the pool counts them, against the requests' block lists.
        "miscounted": {block.block_id for block in pool.blocks if block.ref_count != owners[block.block_id]},
        "free_but_owned": {block_id for block_id in pool.free_queue if owners[block_id]},
    }


def test_the_protocol_returns_to_zero_whatever_happens(checkpoint: Path) -> None:
    engine = make_engine(checkpoint)
    ProtocolMachine.checkpoint = checkpoint
    ProtocolMachine.expected = [engine.generate([prompt], greedy(MAX_TOKENS))[0].token_ids for prompt in PROMPTS]
    run_state_machine_as_test(ProtocolMachine, settings=settings(max_examples=50, stateful_step_count=30,
                                                                 deadline=None))
