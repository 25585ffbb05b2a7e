"""`bench.common.cpu_contention`: real busy-loop competitors that run for the block and are gone after."""

from __future__ import annotations

import time

import psutil
import pytest

from bench.common import cpu_contention


def _eventually(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_competitors_burn_cpu_in_the_block_and_are_reaped_after() -> None:
    with cpu_contention(2) as pids:
        assert len(pids) == 2
        procs = [psutil.Process(pid) for pid in pids]
        _eventually(lambda: all(p.cpu_times().user > 0.05 for p in procs))
    for pid in pids:
        assert not psutil.pid_exists(pid)


def test_competitors_are_stopped_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), cpu_contention(1) as pids:
        raise RuntimeError("benchmark failed")
    assert not psutil.pid_exists(pids[0])


def test_no_competitors() -> None:
    with cpu_contention(0) as pids:
        assert pids == []
