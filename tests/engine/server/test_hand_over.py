"""A draining replica's hand-over ends a stream with `HandedOver` wherever the stream's
consumer happens to be suspended: the gateway counts it as a drain and continues it, instead
of reading a stream that simply stopped. A stream that already ended has nothing to hand over."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.outputs import CompletionOutput, RequestOutput
from engine.server.generation import Generation, HandedOver
from engine.server.metrics import ServerMetrics
from engine.server.state import ServerSettings, ServerState
from fleet_base.sampling_params import SamplingParams


def _out(rid: str, token: int, finish: str | None = None) -> RequestOutput:
    done = CompletionOutput(index=0, delta_text="x", delta_token_ids=[token], finish_reason=finish)
    return RequestOutput(rid, None, [1, 2], [done], finished=finish is not None)


class _Engine:
    """Streams what the test puts on its queue; an abort ends the stream the way the real
    engine does (one final output whose finish reason is "abort")."""

    tokenizer: Any = None
    max_model_len = 256
    model_config: Any = None

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    async def _stream(self) -> AsyncIterator[RequestOutput]:
        while True:
            out = await self.queue.get()
            yield out
            if out.finished:
                return

    def generate(
        self, prompt: Any, params: SamplingParams, request_id: str, **kw: Any
    ) -> AsyncIterator[RequestOutput]:
        return self._stream()

    async def abort(self, request_id: str) -> None:
        await self.queue.put(_out(request_id, 0, "abort"))


async def _generation(engine: _Engine, outputs: list[RequestOutput]) -> tuple[ServerState, Generation]:
    state = ServerState(ServerSettings(served_model_name="m"), ServerMetrics("m"), engine=engine)
    gen = Generation(state, [[1, 2]], SamplingParams(max_tokens=8), "cmpl-1", "prompt")
    gen.allow_hand_over()
    for out in outputs:
        engine.queue.put_nowait(out)
    await gen.start()
    return state, gen


@pytest.mark.parametrize("read", [1, 2, 3])
async def test_a_hand_over_while_the_consumer_is_suspended_ends_the_stream_as_handed_over(read: int) -> None:
    """`read` outputs are taken (the first comes from `start`); the consumer then sits at
    its `yield`, as it does while the server writes a chunk to a slow socket."""
    engine = _Engine()
    state, gen = await _generation(engine, [_out("cmpl-1", t) for t in range(read)])
    outputs = gen.outputs()
    for _ in range(read):
        await outputs.__anext__()
    assert state.hand_over_streams() == 1
    with pytest.raises(HandedOver):
        await asyncio.wait_for(outputs.__anext__(), 5)


async def test_a_stream_that_already_finished_is_not_handed_over() -> None:
    engine = _Engine()
    state, gen = await _generation(engine, [_out("cmpl-1", 1), _out("cmpl-1", 2, "length")])
    outputs = gen.outputs()
    for _ in range(2):
        await outputs.__anext__()
    assert state.hand_over_streams() == 0  # the drain comes while the final chunk is being written
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(outputs.__anext__(), 5)
    assert not gen.handed_over
