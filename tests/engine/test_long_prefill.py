"""The long-prefill cap (vLLM's `--long-prefill-token-threshold`, `--max-long-partial-prefills`):
a short prompt behind a long prefill is scheduled at once, long prompts prefill one at a time,
and a long prompt takes at most T tokens a step, alone too (vLLM's meaning)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerOutput
from fleet_base.openai_contract.priority import engine_priority
from fleet_base.sampling_params import SamplingParams

_tokens = iter(range(10**9))


def _request(
    rid: str, prompt_len: int, arrival: float, *, klass: str | None = None, max_tokens: int = 2
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompt = [1000 + next(_tokens) for _ in range(prompt_len)]  # distinct: no prefix hits between tests
    return Request(rid, prompt, params, priority=engine_priority(klass), arrival_time=arrival)


def _sched(threshold: int, *, budget: int = 32, blocks: int = 256, long_slots: int = 1) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks=blocks, block_size=4),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        max_long_partial_prefills=long_slots,
    )


def _chunks(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def _step(sched: Scheduler, out: SchedulerOutput) -> None:
    sampled = [s.request for s in out.scheduled if s.samples]
    sched.update_after_step(out)
    for r in sampled:
        r.append_output_token(7)
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            sched.finish_request(r, RequestStatus.FINISHED_LENGTH)


def test_a_short_prompt_is_scheduled_beside_a_long_prefill() -> None:
    sched = _sched(threshold=16)
    long = _request("long", 200, arrival=0.0)
    sched.add_request(long)
    first = sched.schedule()
    assert _chunks(first) == {"long": 16}  # T a step, alone too (vLLM's meaning)
    _step(sched, first)
    short = _request("short", 8, arrival=1.0)
    sched.add_request(short)
    assert _chunks(sched.schedule()) == {"long": 16, "short": 8}


def test_without_the_threshold_the_short_prompt_waits_for_the_long_one() -> None:
    sched = _sched(threshold=0)
    long = _request("long", 200, arrival=0.0)
    sched.add_request(long)
    _step(sched, sched.schedule())
    sched.add_request(_request("short", 8, arrival=1.0))
    assert _chunks(sched.schedule()) == {"long": 32}


def test_long_prompts_prefill_one_at_a_time_and_short_ones_go_past_the_second() -> None:
    sched = _sched(threshold=16, budget=64)
    a, b, c = _request("a", 200, 0.0), _request("b", 200, 1.0), _request("c", 8, 2.0)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule()
    assert _chunks(out) == {"a": 16, "c": 8}  # b waits for the long slot; c went past it
    assert [r.request_id for r in sched.waiting] == ["b"]
    # Until a is down to the threshold b stays out; then it is admitted.
    while a.num_tokens - a.num_computed_tokens > 16:
        assert "b" not in _chunks(out)
        _step(sched, out)
        out = sched.schedule()
    assert "b" in _chunks(out)  # the step a is no longer long in


def test_a_less_important_long_prefill_does_not_hold_the_slot_against_a_more_important_one() -> None:
    sched = _sched(threshold=16, budget=64)
    sched.add_request(_request("batch-long", 200, 0.0, klass="batch"))
    _step(sched, sched.schedule())
    sched.add_request(_request("interactive-long", 200, 1.0))
    assert _chunks(sched.schedule()) == {"interactive-long": 16}  # the batch one is deferred meanwhile


def test_the_cap_needs_chunked_prefill_and_room_in_the_step() -> None:
    from pydantic import ValidationError

    from engine.config import EngineArgs

    with pytest.raises(ValidationError, match="chunked prefill"):
        EngineArgs(long_prefill_token_threshold=16, enable_chunked_prefill=False)
    with pytest.raises(ValidationError, match="below max_num_batched_tokens"):
        EngineArgs(long_prefill_token_threshold=2048, max_num_batched_tokens=2048)
    assert EngineArgs(long_prefill_token_threshold=512).long_prefill_token_threshold == 512


def test_two_long_slots_admit_two_long_prompts() -> None:
    sched = _sched(threshold=16, budget=64, long_slots=2)
    for r in (_request("a", 200, 0.0), _request("b", 200, 1.0)):
        sched.add_request(r)
    assert set(_chunks(sched.schedule())) == {"a", "b"}


def test_a_less_important_short_prompt_does_not_pass_a_long_one() -> None:
    sched = _sched(threshold=16, budget=64)
    sched.add_request(_request("a", 200, 0.0))
    _step(sched, sched.schedule())
    sched.add_request(_request("b", 200, 1.0))
    sched.add_request(_request("batch", 8, 2.0, klass="batch"))
    assert set(_chunks(sched.schedule())) == {"a"}  # the batch-class prompt waits behind b


SHARED = [500 + i for i in range(64)]  # a common prefix some prompts start with (prefix-cache hits)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 120), st.integers(1, 4), st.sampled_from([0, 32, 64])),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([0, 8, 24]),
    st.integers(1, 2),
)
def test_every_request_finishes_within_the_budget_and_the_long_slots(
    reqs: list[tuple[int, int, int]], threshold: int, long_slots: int
) -> None:
    budget = 48
    sched = _sched(threshold, budget=budget, blocks=128, long_slots=long_slots)
    requests = []
    for i, (p, o, shared) in enumerate(reqs):
        r = _request(f"r{i}", p, float(i), max_tokens=o)
        r.prompt_token_ids[:0] = SHARED[:shared]
        requests.append(
            Request(r.request_id, r.prompt_token_ids, r.sampling_params, arrival_time=r.arrival_time)
        )
    for r in requests:
        sched.add_request(r)
    for _ in range(3000):
        if not sched.has_work():
            break
        out = sched.schedule()
        assert out.num_tokens <= budget
        assert len(sched.waiting) + len(sched.running) <= len(requests)
        if threshold:  # one priority here: never more long prompts in prefill than slots
            assert (
                sum(1 for r in sched.running if r.num_tokens - r.num_computed_tokens > threshold)
                <= long_slots
            )
            assert all(
                s.num_new_tokens <= threshold
                for s in out.scheduled
                if s.request.num_tokens - s.request.num_computed_tokens > threshold
            )
        _step(sched, out)
    assert not sched.has_work()
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)


def test_on_the_real_model_the_short_prompt_comes_first_and_outputs_do_not_change(smollm2_gguf) -> None:
    from engine import LLM
    from engine import SamplingParams as Params

    greedy = Params(temperature=0.0, max_tokens=8)
    long_prompt = [(i * 7919) % 40_000 + 100 for i in range(600)]
    short_prompts = [[5, 6, 7, 8 + i] for i in range(3)]
    prompts = [long_prompt, *short_prompts]  # the long one first: first come, first served puts it ahead
    outs = {}
    for threshold in (0, 32):
        llm = LLM(
            "smollm2-135m",
            show_progress=False,
            max_num_seqs=8,
            max_model_len=1024,
            max_num_batched_tokens=128,
            long_prefill_token_threshold=threshold,
        )
        outs[threshold] = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs[32]] == [o.token_ids for o in outs[0]]
    long_first = outs[32][0].metrics.first_token_time
    assert all(o.metrics.first_token_time < long_first for o in outs[32][1:])  # went past the long prefill
    plain_first = outs[0][0].metrics.first_token_time
    assert all(o.metrics.first_token_time >= plain_first for o in outs[0][1:])  # waited for all of it
