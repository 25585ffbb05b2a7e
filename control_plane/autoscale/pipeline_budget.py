"""A pipeline's end-to-end latency budget split over its steps, for the autoscaler.

Each step keeps its own policy and its own demand; the budget only adjusts the TTFT target
a step's policy aims at. Every decision (`split`):
1. a step's measured latency is its requests' time in the step (`step_latency`: mean TTFT
   plus the mean decode of its requests), as the SLO policy observes it;
2. its share of the budget is its measured latency over the sum of the steps', smoothed
   over `SHARE_S` (a burst in one step moves its share slowly, so that step shows up as
   over its share) and never below `MIN_SHARE` of an even split (a fast step keeps room);
3. a step whose measured latency exceeds its share of the budget is over budget: its TTFT
   target becomes what its share leaves after its decode (never above its own target,
   never below `MIN_TARGET` of its share); when its decode alone leaves less than that,
   its inter-token latency target too, in proportion to the decode time its share leaves
   (at most halved: more replicas shrink batches, not the per-token floor);
   the steps over budget are ranked by how
   far over they are (`priority` 1 scales first); a step within its share keeps its own
   target: the pipeline never scales it up;
4. a tightened target is never one that replicas cannot buy: where a step's least-load
   latency is known (`StepFloor`: its TTFT on an empty queue and its ITL at batch 1, by the
   capacity model its policy scales with), a target within `FLOOR_MARGIN` of it is out of
   reach, and the step is over budget but "unreachable by scaling": it keeps its own
   targets (no replicas spent on latency no count of them brings) and no priority.
A deployment in several pipelines takes the tightest target. No budget, or no latency
measured yet: every target unchanged. Plain and synchronous: the live loop and `fleetctl
simulate` run the same function, the memory (`BudgetMemory`) handed in."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from control_plane.autoscale.policy import AutoscaleSettings, Observation, ScalerState
from control_plane.autoscale.slo import least_latency
from fleet_base.pipelines import PipelineSpec

SHARE_S = 60.0  # smoothing time constant of the shares
MIN_SHARE = 0.25  # of an even split: a step's least share
MIN_TARGET = 0.1  # of its share of the budget: the tightest TTFT target a step is given
MIN_ITL = 0.5  # of its own ITL target: the tightest the budget sets
# Above the least-load latency, a target must leave this much of it: near the floor the
# capacity model's ITL, decode(batch 1) / (1 - prefill share), needs every replica idle
# 80% of its time (share <= 0.2 at 25%), a count no budget should pay for.
FLOOR_MARGIN = 0.25


@dataclass(frozen=True)
class StepFloor:
    """What a step reaches with the least load (None: not known): no replica count beats it."""

    ttft_s: float | None = None
    itl_s: float | None = None

    def reaches(self, ttft_s: float, itl_s: float | None) -> list[str]:
        """The targets (of TTFT, ITL) out of reach, each with its floor, for the reason."""
        out = []
        for what, target, floor in (("TTFT", ttft_s, self.ttft_s), ("ITL", itl_s, self.itl_s)):
            if target is not None and floor is not None and target < floor * (1 + FLOOR_MARGIN):
                out.append(
                    f"{what} {target * 1000:.3g}ms < {1 + FLOOR_MARGIN:g} x {floor * 1000:.3g}ms at least load"
                )
        return out


@dataclass(frozen=True)
class StepLatency:
    """A step's measured latency (None: no request measured lately) and its TTFT part."""

    total_s: float | None
    ttft_s: float | None = None
    itl_s: float | None = None

    @property
    def decode_s(self) -> float:
        if self.total_s is None or self.ttft_s is None:
            return 0.0
        return max(0.0, self.total_s - self.ttft_s)


def step_latency(obs: Observation) -> StepLatency:
    """Mean TTFT plus mean output tokens after the first x mean ITL (output per request from
    the tick's generated tokens over its arrivals)."""
    if obs.ttft_s is None:
        return StepLatency(None)
    decode = 0.0
    if obs.itl_s is not None and obs.requests_per_s > 0:
        per_request = obs.output_tokens_per_s / obs.requests_per_s
        decode = obs.itl_s * max(0.0, per_request - 1)
    return StepLatency(obs.ttft_s + decode, obs.ttft_s, obs.itl_s)


def step_floor(settings: AutoscaleSettings, state: ScalerState | None, obs: Observation) -> StepFloor:
    """A step's least-load latency by its SLO capacity model (unknown without a profile)."""
    try:
        ttft, itl = least_latency(settings, state, obs)
    except ValueError:
        return StepFloor()
    return StepFloor(ttft, itl)


@dataclass
class BudgetMemory:
    """Smoothed shares by (pipeline, step) and when they were last updated."""

    shares: dict[tuple[str, str], float] = field(default_factory=dict)
    at: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepBudget:
    """One step's part of one decision: its share and budget, and the target it is given."""

    pipeline: str
    step: str
    deployment: str
    share: float
    budget_s: float
    measured_s: float | None
    own_ttft_s: float
    target_ttft_s: float
    over: bool
    priority: int  # 1: the furthest over its share; 0: within it
    reason: str
    target_itl_s: float | None = None  # None: its own
    unreachable: bool = False  # over its share, by more than any replica count buys

    def settings_update(self) -> dict[str, float]:
        """The targets the step's policy aims at this decision (empty: its own)."""
        if not self.over or self.unreachable:
            return {}
        out = {"slo_ttft_s": self.target_ttft_s}
        if self.target_itl_s is not None:
            out["slo_itl_s"] = self.target_itl_s
        return out

    def as_dict(self) -> dict[str, object]:
        return {
            "pipeline": self.pipeline,
            "step": self.step,
            "share": round(self.share, 3),
            "budget_s": round(self.budget_s, 4),
            "measured_s": None if self.measured_s is None else round(self.measured_s, 4),
            "target_ttft_s": round(self.target_ttft_s, 4),
            **({"target_itl_s": round(self.target_itl_s, 4)} if self.target_itl_s is not None else {}),
            "over": self.over,
            "unreachable": self.unreachable,
            "priority": self.priority,
        }


def _smoothed(
    spec: PipelineSpec, latency: Mapping[str, StepLatency], memory: BudgetMemory, now: float
) -> dict[str, float]:
    """The steps' shares this tick (step name -> share, summing to 1)."""
    n = len(spec.steps)
    previous = {s.name: memory.shares.get((spec.name, s.name)) for s in spec.steps}
    measured = {s.name: latency.get(s.deployment, StepLatency(None)).total_s for s in spec.steps}
    known = sum(v for v in measured.values() if v is not None and v > 0)
    # Unmeasured steps keep their share; the measured ones split the rest by their latency.
    kept = {
        name: (previous[name] if previous[name] is not None else 1.0 / n)
        for name, m in measured.items()
        if m is None or known <= 0
    }
    room = max(0.0, 1.0 - sum(kept.values()))
    raw = {name: kept[name] if name in kept else room * (measured[name] or 0.0) / known for name in measured}
    total = sum(raw.values())
    raw = {name: v / total if total > 0 else 1.0 / n for name, v in raw.items()}
    last = memory.at.get(spec.name)
    alpha = 1.0 if last is None else 1.0 - math.exp(-max(0.0, now - last) / SHARE_S)
    mixed = {
        name: (r if previous[name] is None else previous[name] + alpha * (r - previous[name]))
        for name, r in raw.items()
    }
    for name, v in mixed.items():
        memory.shares[(spec.name, name)] = v
    memory.at[spec.name] = now
    return _floored(mixed, MIN_SHARE / n)


def _floored(shares: dict[str, float], floor: float) -> dict[str, float]:
    """Each share at least `floor`, the rest split in proportion among the others."""
    low: set[str] = set()
    while True:
        rest = 1.0 - floor * len(low)
        above = {k: v for k, v in shares.items() if k not in low}
        total = sum(above.values())
        out = {k: (floor if k in low else rest * v / total if total > 0 else rest / len(above))
               for k, v in shares.items()}  # fmt: skip
        newly = {k for k, v in out.items() if k not in low and v < floor}
        if not newly:
            return out
        low |= newly


def _one(
    spec: PipelineSpec,
    latency: Mapping[str, StepLatency],
    own_ttft: Mapping[str, float],
    memory: BudgetMemory,
    now: float,
    own_itl: Mapping[str, float] | None = None,
    floors: Mapping[str, StepFloor] | None = None,
) -> list[StepBudget]:
    assert spec.slo_e2e_s is not None
    budget = spec.slo_e2e_s
    shares = _smoothed(spec, latency, memory, now)
    measured = [latency.get(s.deployment, StepLatency(None)).total_s for s in spec.steps]
    total = sum(m for m in measured if m is not None)
    whole = f"pipeline {spec.name} {total * 1000:.0f}ms of its {budget * 1000:.0f}ms budget"
    rows: list[tuple[float, StepBudget]] = []
    for s in spec.steps:
        lat = latency.get(s.deployment, StepLatency(None))
        share = shares[s.name]
        mine = share * budget
        own = own_ttft.get(s.deployment)
        own_i = (own_itl or {}).get(s.deployment)
        if own is None:
            continue
        over = lat.total_s is not None and lat.total_s > mine
        unreachable = False
        if over:
            assert lat.total_s is not None
            left = mine - lat.decode_s
            target = min(own, max(left, MIN_TARGET * mine))
            itl, note = None, ""
            if left < MIN_TARGET * mine:
                note = f", decode alone {lat.decode_s * 1000:.0f}ms"
                if lat.itl_s is not None and own_i is not None and lat.decode_s > 0:
                    wanted = lat.itl_s * (1 - MIN_TARGET) * mine / lat.decode_s
                    itl = min(own_i, max(wanted, MIN_ITL * own_i))
                    note += f"; ITL target {own_i * 1000:g}ms -> {itl * 1000:.3g}ms"
            out_of_reach = (
                (floors or {})
                .get(s.deployment, StepFloor())
                .reaches(
                    target if target < own else None,
                    itl if itl is not None and itl < (own_i or 0.0) else None,
                )
            )
            head = (
                f"{whole}: step {s.name} over its share {100 * share:.0f}% "
                f"({lat.total_s * 1000:.0f}ms > {mine * 1000:.0f}ms"
            )
            if out_of_reach:
                reason = (
                    f"{head}), over budget: unreachable by scaling ({'; '.join(out_of_reach)}), "
                    f"its own targets kept"
                )
                target, itl, excess, unreachable = own, None, 0.0, True
            else:
                reason = f"{head}{note}), TTFT target {own:g}s -> {target:.3g}s"
                excess = lat.total_s / mine
        else:
            target, excess, itl = own, 0.0, None
            seen = "not measured" if lat.total_s is None else f"{lat.total_s * 1000:.0f}ms"
            reason = (
                f"{whole}: step {s.name} within its share {100 * share:.0f}% ({seen} <= {mine * 1000:.0f}ms)"
            )
        rows.append((excess, StepBudget(spec.name, s.name, s.deployment, share, mine, lat.total_s,
                                        own, target, over, 0, reason, itl, unreachable)))  # fmt: skip
    ranked = sorted((r for r in rows if r[1].over and not r[1].unreachable), key=lambda r: (-r[0], r[1].step))
    rank = {r[1].step: i + 1 for i, r in enumerate(ranked)}
    return [replace(b, priority=rank.get(b.step, 0)) for _, b in rows]


def split(
    pipelines: Iterable[PipelineSpec],
    latency: Mapping[str, StepLatency],
    own_ttft: Mapping[str, float],
    memory: BudgetMemory,
    now: float,
    own_itl: Mapping[str, float] | None = None,
    floors: Mapping[str, StepFloor] | None = None,
) -> dict[str, StepBudget]:
    """Deployment -> the budget decision it follows (the tightest of its pipelines'). Only
    deployments that are steps of a pipeline with a budget, and whose own target is known
    (`own_ttft`: deployment -> its `slo_ttft_s`; `own_itl`: its `slo_itl_s`, None: ITL
    never tightened; `floors`: its least-load latency, None: never floored), appear."""
    out: dict[str, StepBudget] = {}
    for spec in pipelines:
        if spec.slo_e2e_s is None:
            continue
        for b in _one(spec, latency, own_ttft, memory, now, own_itl, floors):
            before = out.get(b.deployment)
            if before is None or (b.target_ttft_s, -b.priority) < (before.target_ttft_s, -before.priority):
                out[b.deployment] = b
    return out
