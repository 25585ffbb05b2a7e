"""The batch priority class in the engine: the scheduler admits a batch request after an
interactive one that arrived later and preempts it first, and the server takes the class
from the gateway's header."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request as HttpRequest

from engine.kv_cache import KVCacheManager
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request
from engine.scheduler import Scheduler
from engine.server.generation import Generation
from engine.server.metrics import ServerMetrics
from engine.server.state import ServerSettings, ServerState
from fleet_base.openai_contract.priority import (
    BATCH_PRIORITY,
    DEFAULT_PRIORITY,
    PRIORITY_CLASS_HEADER,
    engine_priority,
)
from fleet_base.sampling_params import SamplingParams


def _request(rid: str, klass: str | None, arrival: float, prompt_len: int = 4) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=64)
    return Request(
        rid, list(range(1, prompt_len + 1)), params, priority=engine_priority(klass), arrival_time=arrival
    )


@pytest.mark.parametrize(
    ("klass", "priority"),
    [
        ("batch", BATCH_PRIORITY),
        ("BATCH", BATCH_PRIORITY),
        ("interactive", DEFAULT_PRIORITY),
        ("standard", DEFAULT_PRIORITY),
        ("", DEFAULT_PRIORITY),
        (None, DEFAULT_PRIORITY),
        ("batchy", DEFAULT_PRIORITY),
    ],
)
def test_only_the_batch_class_is_scheduled_lower(klass: str | None, priority: int) -> None:
    assert engine_priority(klass) == priority
    assert BATCH_PRIORITY > DEFAULT_PRIORITY  # lower value = more important


def test_a_waiting_batch_request_is_admitted_after_a_later_interactive_one() -> None:
    sched = Scheduler(KVCacheManager(num_blocks=16, block_size=4), max_num_seqs=1, max_num_batched_tokens=64)
    batch = _request("batch", "batch", arrival=1.0)
    interactive = _request("interactive", "interactive", arrival=2.0)  # arrived later
    sched.add_request(batch)
    sched.add_request(interactive)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["interactive"]
    sched.finish_request(interactive, interactive.status.FINISHED_STOPPED)
    assert [s.request.request_id for s in sched.schedule().scheduled] == ["batch"]


def test_the_batch_request_is_preempted_first_when_the_cache_runs_out() -> None:
    # 2 blocks of 4 slots each for two 4-token prompts: the next token of either needs a third
    sched = Scheduler(KVCacheManager(num_blocks=3, block_size=4), max_num_seqs=4, max_num_batched_tokens=64)
    interactive = _request("interactive", "interactive", arrival=2.0)
    batch = _request("batch", "batch", arrival=1.0)  # older: by arrival alone it would stay
    sched.add_request(batch)
    sched.add_request(interactive)
    out = sched.schedule()
    assert {s.request.request_id for s in out.scheduled} == {"interactive", "batch"}
    sched.update_after_step(out)
    for r in (interactive, batch):
        r.append_output_token(7)
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["batch"]
    assert [s.request.request_id for s in out.scheduled] == ["interactive"]


class _Engine:
    """Answers every request at once and remembers the priority it was given."""

    tokenizer: Any = None
    max_model_len = 256
    model_config: Any = None

    def __init__(self) -> None:
        self.priorities: list[int] = []

    async def _one(self, request_id: str) -> AsyncIterator[RequestOutput]:
        out = CompletionOutput(index=0, text="x", token_ids=[5], finish_reason="stop")
        yield RequestOutput(request_id, None, [1, 2], [out], finished=True)

    def generate(
        self, prompt: Any, params: SamplingParams, request_id: str, priority: int = 0, **kw: Any
    ) -> AsyncIterator[RequestOutput]:
        self.priorities.append(priority)
        return self._one(request_id)

    async def abort(self, request_id: str) -> None:
        pass


def _http(headers: dict[str, str]) -> HttpRequest:
    async def receive() -> dict[str, Any]:  # the client stays: nothing more arrives
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return HttpRequest({"type": "http", "method": "POST", "path": "/", "headers": raw}, receive)


@pytest.mark.parametrize(
    ("headers", "priority"),
    [
        ({PRIORITY_CLASS_HEADER: "batch"}, BATCH_PRIORITY),
        ({PRIORITY_CLASS_HEADER: "interactive"}, 0),
        ({}, 0),
    ],
)
async def test_the_server_takes_the_class_from_the_gateways_header(headers: dict, priority: int) -> None:
    engine = _Engine()
    state = ServerState(ServerSettings(served_model_name="m"), ServerMetrics("m"), engine=engine)
    gen = Generation(state, [[1, 2]], SamplingParams(max_tokens=1), "cmpl-1", "prompt")
    await gen.run(_http(headers), stream=False)
    assert engine.priorities == [priority]


def _decoding(sched: Scheduler, *requests: Request) -> None:
    """Admit `requests` and prefill them, so each is running and decoding."""
    for r in requests:
        sched.add_request(r)
    out = sched.schedule()
    sched.update_after_step(out)
    for s in out.scheduled:
        s.request.append_output_token(7)


def test_running_batch_requests_sit_out_an_interactive_prefill_step() -> None:
    sched = Scheduler(KVCacheManager(num_blocks=64, block_size=4), max_num_seqs=8, max_num_batched_tokens=256)
    batch = [_request(f"b{i}", "batch", arrival=float(i)) for i in range(3)]
    _decoding(sched, *batch)
    interactive = _request("interactive", "interactive", arrival=9.0, prompt_len=12)
    sched.add_request(interactive)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == [
        "interactive"
    ]  # its first token waits for no decode
    assert not out.preempted and all(b.status.name == "RUNNING" for b in batch)  # deferred, blocks kept
    sched.update_after_step(out)
    interactive.append_output_token(7)
    out = sched.schedule()  # nothing left to prefill: everyone decodes together again
    assert {s.request.request_id for s in out.scheduled} == {"interactive", "b0", "b1", "b2"}


def test_the_batch_runs_when_the_interactive_request_cannot_get_in() -> None:
    # no slot: the interactive request waits for a batch request to finish, so the batch must go on
    sched = Scheduler(KVCacheManager(num_blocks=64, block_size=4), max_num_seqs=2, max_num_batched_tokens=256)
    batch = [_request(f"b{i}", "batch", arrival=float(i)) for i in range(2)]
    _decoding(sched, *batch)
    sched.add_request(_request("interactive", "interactive", arrival=9.0))
    assert {s.request.request_id for s in sched.schedule().scheduled} == {"b0", "b1"}
    # a free slot but no blocks for its prompt: the same
    sched = Scheduler(KVCacheManager(num_blocks=4, block_size=4), max_num_seqs=8, max_num_batched_tokens=256)
    batch = [_request(f"b{i}", "batch", arrival=float(i)) for i in range(2)]
    _decoding(sched, *batch)
    sched.add_request(_request("interactive", "interactive", arrival=9.0, prompt_len=40))
    out = sched.schedule()
    assert "interactive" not in {s.request.request_id for s in out.scheduled}
    assert {s.request.request_id for s in out.scheduled} & {"b0", "b1"}


def _distinct(rid: str, klass: str, arrival: float, prompt_len: int, first_token: int) -> Request:
    """A request whose prompt shares no block with another's (no prefix hits)."""
    params = SamplingParams(temperature=0.0, max_tokens=64)
    ids = list(range(first_token, first_token + prompt_len))
    return Request(rid, ids, params, priority=engine_priority(klass), arrival_time=arrival)


def test_batch_prefill_is_held_to_its_time_share_of_a_step() -> None:
    sched = Scheduler(
        KVCacheManager(num_blocks=256, block_size=4),
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        low_priority_step_s=0.02,
    )
    first = _distinct("b0", "batch", 0.0, 100, 1000)
    sched.add_request(first)
    assert sched.schedule().scheduled[0].num_new_tokens == 100  # nothing measured yet: no limit
    sched.observe_step(100, 0.1)  # 1 ms a token: 20 ms is 20 tokens
    assert sched.seconds_per_token == pytest.approx(0.001)
    sched.observe_step(4, 1.0)  # a small step is mostly fixed cost: not learnt from
    assert sched.seconds_per_token == pytest.approx(0.001)
    batch = [_distinct(f"b{i}", "batch", float(i), 30, 2000 + 100 * i) for i in range(1, 4)]
    interactive = _distinct("i", "interactive", 9.0, 60, 3000)
    for r in (*batch, interactive):
        sched.add_request(r)
    out = sched.schedule()
    got = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert got.get("i") == 60  # the interactive prompt is never held
    assert sum(n for rid, n in got.items() if rid != "i") <= 20
    sched.update_after_step(out)
    # step after step, the batch prompts are prefilled in shares: each step <= 20 batch tokens
    for _ in range(12):
        out = sched.schedule()
        assert sum(s.num_new_tokens for s in out.scheduled if s.request.priority > 0) <= 20
        sched.update_after_step(out)
        for s in out.scheduled:
            if s.samples:
                s.request.append_output_token(7)
    assert all(r.num_computed_tokens >= r.num_prompt_tokens for r in batch)  # they still got through
