"""One deployment's autoscaler memory as data: what `ScalerState` holds (the demand
window, the recent desired counts behind the scale-down delay, panic, the last demand
and the first observation) and the policies' own memories (the SLO policy's load trends,
TTFT correction, prompt mix, burst memory and daily and weekly cycles; the planner's open
interval), so a new leader resumes with the memory its predecessor had instead of meeting
the next burst like a fresh deployment.

Stored in two parts (`control_plane.loops.autoscale_store`): `dump`, everything but the
cycles (a few kB, changing every decision), and `dump_cycles`, the daily and weekly
cycles (up to ~250 kB a deployment, learning in 15-minute slots), which the loop stores
far less often. Pure. The policies' memories are their own dataclasses, validated field by
field, so a field added to them is stored without a change here; a memory of a type not
listed here is left out (the policy starts that part afresh)."""

from __future__ import annotations

import copy
import math
from collections import deque

from pydantic import BaseModel, ConfigDict, Field

from control_plane.autoscale.planner import Interval
from control_plane.autoscale.policy import ScalerState
from control_plane.autoscale.seasonal import Seasons
from control_plane.autoscale.slo import SloMemory

WITHOUT_CYCLES = {"cycles": True, "slo": {"__all__": {"seasons"}}}


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
    cycles: dict[str, Seasons] = Field(default_factory=dict)  # the SLO memories' cycles, by policy name

    def state(self) -> ScalerState:
        """A live state of its own (the snapshot is left as it is)."""
        slo = copy.deepcopy(self.slo)
        for name, seasons in self.cycles.items():
            if name in slo:
                slo[name].seasons = copy.deepcopy(seasons)
        return ScalerState(
            samples=deque(self.samples),
            recent=deque(self.recent),
            panic_until=self.panic_until,
            last_demand_at=self.last_demand_at,
            first_at=self.first_at,
            memory={**slo, **copy.deepcopy(self.planner)},
        )


class StoredCycles(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    cycles: dict[str, Seasons] = Field(default_factory=dict)


def snapshot(state: ScalerState, at: float) -> ScalerSnapshot:
    slo = {k: v for k, v in state.memory.items() if isinstance(v, SloMemory)}
    return ScalerSnapshot(
        at=at,
        samples=list(state.samples),
        recent=list(state.recent),
        panic_until=state.panic_until,
        last_demand_at=state.last_demand_at,
        first_at=state.first_at,
        slo=slo,
        planner={k: v for k, v in state.memory.items() if isinstance(v, Interval)},
        cycles={k: v.seasons for k, v in slo.items()},
    )


def dump(state: ScalerState, at: float) -> str:
    """Everything but the cycles."""
    return snapshot(state, at).model_dump_json(exclude=WITHOUT_CYCLES)


def dump_cycles(state: ScalerState) -> str:
    slo = {k: v.seasons for k, v in state.memory.items() if isinstance(v, SloMemory)}
    return StoredCycles(cycles=slo).model_dump_json()


def load(text: str, cycles: str | None = None) -> ScalerSnapshot:
    """The stored parts back (without `cycles`, the SLO memories start theirs afresh)."""
    snap = ScalerSnapshot.model_validate_json(text)
    if cycles:
        snap.cycles = StoredCycles.model_validate_json(cycles).cycles
    return snap


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
