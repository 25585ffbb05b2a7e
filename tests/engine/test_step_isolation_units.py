"""Finding the requests a failed step cannot run with, without a model: the units that must
run together, the bisection, what each culprit's client is told, and the prefix cache that
must not keep blocks a failed step never wrote."""

from __future__ import annotations

import pytest
import torch

from engine.errors import AdapterUnavailableError, StepFailedError, StepInputError
from engine.kv_cache import KVCacheManager
from engine.lora import LoRAAdapterError
from engine.request import Request
from engine.step_isolation import GlobalStepError, bisect, is_global, request_error, units
from fleet_base.sampling_params import SamplingParams


def test_a_request_reading_blocks_another_writes_this_step_runs_with_it() -> None:
    # 0 writes blocks 10, 11; 1 was admitted with a hit on 10 (same prefix); 2 is alone.
    tables = [[10, 11], [10, 12], [20]]
    written = [range(0, 2), range(1, 2), range(0, 1)]
    assert sorted(units(tables, written)) == [[0, 1], [2]]
    # Decodes that only share old (computed) prefix blocks are independent.
    assert sorted(units([[5, 6], [5, 7]], [range(1, 2), range(1, 2)])) == [[0], [1]]


def test_bisect_pins_the_failure_on_the_one_bad_unit_and_runs_the_rest() -> None:
    batch = [f"r{i}" for i in range(8)]
    calls: list[list[str]] = []

    def run(sub: list[str]) -> list[str]:
        calls.append(sub)
        if "r5" in sub:
            raise RuntimeError("a kernel refused r5's shape")
        return sub

    found = bisect(batch, [[i] for i in range(8)], RuntimeError("first"), run)
    assert [(unit, str(err)) for unit, err in found.culprits] == [(["r5"], "a kernel refused r5's shape")]
    assert sorted(found.outputs) == sorted(set(batch) - {"r5"})
    assert found.ran and found.runs == len(calls) <= 2 * 3  # 2 log2(8)
    assert all(sub == sorted(sub) for sub in calls)  # the batch's own order is kept


def test_a_unit_alone_is_not_run_again_and_a_global_error_stops_the_bisection() -> None:
    found = bisect(["a"], [[0]], ValueError("x"), lambda sub: pytest.fail("ran again"))
    assert [u for u, _ in found.culprits] == [["a"]] and not found.ran

    def oom(sub: list[str]) -> list[str]:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(GlobalStepError):
        bisect(["a", "b"], [[0], [1]], RuntimeError("x"), oom)
    assert is_global(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_global(RuntimeError("shape mismatch"))


def test_each_culprit_is_told_whose_fault_it_was() -> None:
    assert isinstance(request_error(LoRAAdapterError("gone")), AdapterUnavailableError)
    assert isinstance(request_error(ValueError("bad token")), StepInputError)
    assert isinstance(request_error(RuntimeError("kernel")), StepFailedError)


def test_blocks_a_failed_step_never_wrote_leave_the_prefix_cache() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    params = SamplingParams()
    a = Request(request_id="a", prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=params)
    assert mgr.allocate_slots(a, a.num_tokens)  # full blocks are hashed when allocated
    mgr.forget_uncomputed(a)  # the step that was to compute them failed
    mgr.free(a)
    b = Request(request_id="b", prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=params)
    assert mgr.get_computed_blocks(b) == ([], 0)
    # Blocks that were computed stay cached.
    c = Request(request_id="c", prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=params)
    assert mgr.allocate_slots(c, c.num_tokens)
    c.num_computed_tokens = 4
    mgr.forget_uncomputed(c)
    mgr.free(c)
    assert mgr.get_computed_blocks(b)[1] == 4
