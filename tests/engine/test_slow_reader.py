"""A consumer that stops reading costs the engine a bounded amount: streamed outputs carry
only what is new, and past `max_unread_bytes` left unread the request is aborted and its
KV blocks freed while the other requests go on."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncLLM, SamplingParams
from engine.errors import SlowReaderError
from tests.polling import eventually

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> AsyncLLM:
    engine = AsyncLLM(
        "smollm2-135m", show_progress=False, max_model_len=1024, max_unread_bytes=32 << 10, weights="fp32"
    )
    yield engine
    engine.shutdown()


async def test_streamed_outputs_carry_only_what_is_new(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2, logprobs=2)
    outs = [out async for out in engine.generate("Count: one, two,", params)]
    final = outs[-1]
    assert final.finished and all(not o.finished for o in outs[:-1])
    for out in outs[:-1]:  # earlier outputs: only what is new, nothing cumulative
        for o in out.outputs:
            assert o.text == "" and o.token_ids == [] and o.logprobs is None
    for o in final.outputs:  # the final one carries the whole sequence, as deltas add up
        seq = [c for out in outs for c in out.outputs if c.index == o.index]
        assert "".join(c.delta_text for c in seq) == o.text
        assert [t for c in seq for t in c.delta_token_ids] == o.token_ids and len(o.token_ids) == 16
        assert [lp for c in seq for lp in c.delta_logprobs or []] == o.logprobs


async def test_a_reader_that_stops_is_aborted_and_its_blocks_freed(engine: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=900, ignore_eos=True, logprobs=5)
    stalled = engine.generate("Write a long essay about rivers.", params, "stalled")
    await stalled.__anext__()  # admitted; from here on nobody reads
    stream = engine._streams["stalled"]
    queued: list[int] = []

    async def watch() -> None:
        while "stalled" in engine._streams and not stream.cut:
            queued.append(stream.unread)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    # a well-behaved request meanwhile is served in full
    good = [
        out
        async for out in engine.generate(
            "The capital of France is", SamplingParams(max_tokens=8, ignore_eos=True)
        )
    ]
    assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 8

    await eventually(lambda: stream.cut, 120, "the stalled request to be cut", 0.02)
    await eventually(
        lambda: engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0,
        30,
        "the stalled request aborted and its blocks freed",
        0.02,
    )
    watcher.cancel()
    # what the engine held for it stayed near the bound, then was dropped
    assert max(queued) <= engine.args.max_unread_bytes + 16384, max(queued)  # + one step's output
    assert stream.unread == 0 and stream.queue.qsize() == 1
    assert engine.stats().num_aborted_slow_reader == 1
    with pytest.raises(SlowReaderError):
        await stalled.__anext__()
    assert "stalled" not in engine._streams
