"""`bench.common.cpu_contention`: real busy-loop competitors that run for the block and are gone after."""

from __future__ import annotations

import psutil
import pytest

from bench.common import cpu_contention
from tests.polling import wait_for


def test_competitors_burn_cpu_in_the_block_and_are_reaped_after() -> None:
    with cpu_contention(2) as pids:
        assert len(pids) == 2
        procs = [psutil.Process(pid) for pid in pids]
        wait_for(
            lambda: all(p.cpu_times().user > 0.05 for p in procs), 10, "the competitors burning CPU", 0.05
        )
    for pid in pids:
        assert not psutil.pid_exists(pid)


def test_competitors_are_stopped_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), cpu_contention(1) as pids:
        raise RuntimeError("benchmark failed")
    assert not psutil.pid_exists(pids[0])


def test_no_competitors() -> None:
    with cpu_contention(0) as pids:
        assert pids == []
