"""One deployment's autoscaler memory as data: what `ScalerState` holds (the demand
window, the recent desired counts behind the scale-down delay, panic, the last demand
and the first observation) and the policies' own memories (the SLO policy's load trends,
TTFT correction, prompt mix, burst memory and daily and weekly cycles; the planner's open
interval), so a new leader resumes with the memory its predecessor had instead of meeting
the next burst like a fresh deployment.

Pure: the autoscale loop stores `dump` in the database and `load`s it on start
(`control_plane.loops.autoscale_store`). The policies' memories are their own dataclasses,
validated field by field, so a field added to them is stored without a change here; a
memory of a type not listed here is left out (the policy starts that part afresh)."""

from __future__ import annotations

import math
from collections import deque

from pydantic import BaseModel, ConfigDict, Field

from control_plane.autoscale.planner import Interval
from control_plane.autoscale.policy import ScalerState
from control_plane.autoscale.slo import SloMemory


class ScalerSnapshot(BaseModel):
    """`ScalerState` at `at` (the time of the last observation it took)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    at: float
    samples: list[tuple[float, float]] = Field(default_factory=list)
    recent: list[tuple[float, int]] = Field(default_factory=list)
    panic_until: float = -math.inf
    last_demand_at: float = -math.inf
    first_at: float | None = None
    slo: dict[str, SloMemory] = Field(default_factory=dict)  # by policy name (`slo`, `ours`)
    planner: dict[str, Interval] = Field(default_factory=dict)

    def state(self) -> ScalerState:
        memory: dict[str, object] = {**self.slo, **self.planner}
        return ScalerState(
            samples=deque(self.samples),
            recent=deque(self.recent),
            panic_until=self.panic_until,
            last_demand_at=self.last_demand_at,
            first_at=self.first_at,
            memory=memory,
        )


def snapshot(state: ScalerState, at: float) -> ScalerSnapshot:
    return ScalerSnapshot(
        at=at,
        samples=list(state.samples),
        recent=list(state.recent),
        panic_until=state.panic_until,
        last_demand_at=state.last_demand_at,
        first_at=state.first_at,
        slo={k: v for k, v in state.memory.items() if isinstance(v, SloMemory)},
        planner={k: v for k, v in state.memory.items() if isinstance(v, Interval)},
    )


def dump(state: ScalerState, at: float) -> str:
    return snapshot(state, at).model_dump_json()


def load(text: str) -> ScalerSnapshot:
    return ScalerSnapshot.model_validate_json(text)


def resumed(snap: ScalerSnapshot, now: float, window_s: float) -> ScalerState:
    """The stored state, taken up at `now`. Its windows carry on across a gap shorter than
    `window_s` (the stable window: what is left of it is real demand). After a longer gap
    the window is blind, so the rule of a fresh autoscaler applies again (no scale-down
    before one full window); the long memories (bursts, cycles, trends, the recent desired
    counts of the scale-down delay) are kept either way: they only hold capacity."""
    state = snap.state()
    if now - snap.at > window_s:
        state.first_at = None
    return state
