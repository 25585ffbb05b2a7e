"""Starting the control loops is all or nothing: a part that fails to start stops the parts
already started and raises, so a leader never runs half its loops or leaks the rest."""

from __future__ import annotations

import asyncio

import pytest

import control_plane.loops as loops_module
from control_plane.context import ControlPlaneContext
from control_plane.settings import Settings


async def test_a_part_that_fails_to_start_stops_what_had_started(sessions, monkeypatch):
    ctx = ControlPlaneContext(settings=Settings(), sessions=sessions, nats=None)
    started: list[loops_module.Loops] = []
    real_start = loops_module.Loops.start

    async def record(self):
        started.append(self)
        return await real_start(self)

    async def broken_rollouts(*_args, **_kwargs):
        raise RuntimeError("rollout replay failed")

    monkeypatch.setattr(loops_module.Loops, "start", record)
    monkeypatch.setattr(loops_module, "start_rollout_loop", broken_rollouts)
    before = {t for t in asyncio.all_tasks() if not t.done()}
    with pytest.raises(RuntimeError, match="rollout replay failed"):
        await loops_module.start_loops(ctx)
    await asyncio.sleep(0)
    (loops,) = started
    assert loops._stopping
    leaked = [
        t for t in asyncio.all_tasks() if not t.done() and t not in before and t is not asyncio.current_task()
    ]
    assert leaked == [], [t.get_name() for t in leaked]
