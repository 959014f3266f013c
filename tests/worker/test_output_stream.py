"""A request's output stream merges what its consumer has not read yet: one pending output however
many steps ran, holding all their news in order; endings and errors are never folded away."""

from __future__ import annotations

import asyncio

from cluster.common.events import FinishReason, TokenLogprobs
from cluster.engine.llm_engine import RequestOutput
from cluster.worker.output_stream import OutputStream


def _output(index: int, token: int, finished: bool = False, first_token_time: float | None = None) -> RequestOutput:
    text = "".join(f"t{i}" for i in range(index + 1))
    return RequestOutput("r", [token], f"t{token}", list(range(index + 1)), index, text, finished,
                         FinishReason.LENGTH if finished else None, 7, 3,
                         [TokenLogprobs(token, -0.5, [(token, -0.5)])], None, 1.0, first_token_time)


def test_outputs_not_yet_read_merge_into_one_with_all_their_news() -> None:
    async def run() -> None:
        stream = OutputStream()
        for index in range(5):
            stream.put(_output(index, 100 + index, first_token_time=2.0 + index))
        assert len(stream) == 1
        merged = await stream.get()
        assert isinstance(merged, RequestOutput)
        assert merged.index == 0 and merged.new_token_ids == [100, 101, 102, 103, 104]
        assert merged.new_text == "t100t101t102t103t104"
        assert [entry.token_id for entry in merged.new_logprobs] == [100, 101, 102, 103, 104]
        assert merged.token_ids == [0, 1, 2, 3, 4] and merged.first_token_time == 2.0
        assert not merged.finished
        stream.put(_output(5, 105))
        later = await stream.get()
        assert isinstance(later, RequestOutput) and later.index == 5 and later.new_token_ids == [105]

    asyncio.run(run())


def test_an_ending_is_merged_into_but_nothing_after_it_and_errors_stand_alone() -> None:
    async def run() -> None:
        stream = OutputStream()
        stream.put(_output(0, 100))
        stream.put(_output(1, 101, finished=True))
        stream.put(_output(2, 102))  # after the end (never happens): kept apart, not hidden in it
        error = RuntimeError("worker failed")
        stream.put(error)
        stream.put(_output(3, 103))
        first = await stream.get()
        assert isinstance(first, RequestOutput) and first.new_token_ids == [100, 101] and first.finished
        assert first.finish_reason == FinishReason.LENGTH
        after = await stream.get()
        assert isinstance(after, RequestOutput) and after.new_token_ids == [102]
        assert await stream.get() is error
        assert len(stream) == 1

    asyncio.run(run())


def test_a_reader_waits_for_the_next_output() -> None:
    async def run() -> None:
        stream = OutputStream()
        reader = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0.01)
        assert not reader.done()
        stream.put(_output(0, 100))
        assert (await asyncio.wait_for(reader, 1)).new_token_ids == [100]  # type: ignore[union-attr]

    asyncio.run(run())
