"""A pipeline's end-to-end latency budget split over its steps, for the autoscaler.

Each step keeps its own policy and its own demand; the budget only adjusts the TTFT target
a step's policy aims at. Every decision (`split`):
1. a step's measured latency is its requests' time in the step (`step_latency`: mean TTFT
   plus the mean decode of its requests), as the SLO policy observes it;
2. its share of the budget is what it needs at least over what every step needs at least:
   its least-load latency (`StepFloor.latency`: TTFT on an empty queue plus its requests'
   decode at batch 1, by the capacity model its policy scales with, at its correction); a
   step with no profile (floor unknown) needs its measured latency instead. Shares are
   smoothed over `SHARE_S` and never below `MIN_SHARE` of an even split (a fast step keeps room).
   Shares from floors do not move with load, so under overload the steps are not all over
   by the same ratio: the one furthest above what it could reach stands out;
3. a step whose measured latency exceeds its share of the budget is over its share; the steps
   over are ranked by measured / share (`priority` 1: the furthest over; ties: the larger
   excess in seconds, then an equal priority, never the name). While the pipeline's measured
   latency is within the budget nobody is tightened. Over it, the steps over their shares are
   tightened in priority order, each to its share, until the pipeline would meet the budget
   with the steps not yet tightened at their measured latency: a step over its share whose
   excess the others' slack absorbs keeps its own targets (`tightened` False). With every
   step over its share (no slack anywhere), every reachable one is tightened.
   A tightened step's TTFT target is what its share leaves after its decode (never above its
   own target, never below `MIN_TARGET` of its share); when its decode alone leaves less than
   that, its inter-token latency target too, in proportion to the decode time its share leaves
   (at most halved: more replicas shrink batches, not the per-token floor);
   a step within its share keeps its own target: the pipeline never scales it up;
4. a tightened target is never one that replicas cannot buy: a target within `FLOOR_MARGIN`
   of the step's least-load TTFT or ITL is out of reach, and the step is over budget but
   "unreachable by scaling": it keeps its own targets (no replicas spent on latency no count
   of them brings) and no priority.
A deployment in several pipelines takes the tightest target. No budget, or no latency
measured yet: every target unchanged. The memory forgets pipelines no longer given and a
pipeline whose steps changed (a recreated pipeline starts from fresh shares). Plain and
synchronous: the live loop and `fleetctl simulate` run the same function, the memory
(`BudgetMemory`) handed in."""

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

    def latency(self, measured: StepLatency) -> float | None:
        """The step's latency with the least load for its requests as measured (their prompts,
        their output tokens): TTFT floor plus the tokens after the first at the ITL floor."""
        if self.ttft_s is None:
            return None
        tokens = measured.decode_s / measured.itl_s if measured.itl_s else 0.0
        return self.ttft_s + (self.itl_s or 0.0) * tokens


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
    """Smoothed shares by (pipeline, step), when they were last updated, and the steps each
    pipeline had then."""

    shares: dict[tuple[str, str], float] = field(default_factory=dict)
    at: dict[str, float] = field(default_factory=dict)
    steps: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def keep(self, pipelines: Iterable[PipelineSpec]) -> None:
        """Forget pipelines not given and those whose steps changed (recreated: fresh shares)."""
        now = {p.name: tuple((s.name, s.deployment) for s in p.steps) for p in pipelines}
        stale = {name for name, steps in self.steps.items() if now.get(name) != steps}
        stale |= {name for name, _ in self.shares if name not in now} | {n for n in self.at if n not in now}
        self.shares = {k: v for k, v in self.shares.items() if k[0] not in stale}
        self.at = {k: v for k, v in self.at.items() if k not in stale}
        self.steps = {k: v for k, v in now.items()}


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
    priority: int  # 1: the furthest over its share; 0: within it (or unreachable)
    reason: str
    target_itl_s: float | None = None  # None: its own
    unreachable: bool = False  # over its share, by more than any replica count buys
    need_s: float | None = None  # its least-load latency (None: unknown, its share from measured)
    tightened: bool = True  # over its share and its targets tightened this decision

    def settings_update(self) -> dict[str, float]:
        """The targets the step's policy aims at this decision (empty: its own)."""
        if not self.over or self.unreachable or not self.tightened:
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
            "tightened": bool(self.settings_update()),
            **({"need_s": round(self.need_s, 4)} if self.need_s is not None else {}),
        }


def _smoothed(
    spec: PipelineSpec, needs: Mapping[str, float | None], memory: BudgetMemory, now: float
) -> dict[str, float]:
    """The steps' shares this tick (step name -> share, summing to 1) from what each needs
    (step name -> seconds; None: not known this tick)."""
    n = len(spec.steps)
    previous = {s.name: memory.shares.get((spec.name, s.name)) for s in spec.steps}
    measured = dict(needs)
    known = sum(v for v in measured.values() if v is not None and v > 0)
    # Steps with no need known keep their share; the others split the rest by their need.
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


def _need(lat: StepLatency, floor: StepFloor | None) -> float | None:
    """What a step needs at least: its least-load latency, else its measured latency."""
    least = floor.latency(lat) if floor is not None else None
    return least if least is not None and least > 0 else lat.total_s


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
    lats = {s.name: latency.get(s.deployment, StepLatency(None)) for s in spec.steps}
    least = {s.name: (floors or {}).get(s.deployment) for s in spec.steps}
    needs = {s.name: _need(lats[s.name], least[s.name]) for s in spec.steps}
    shares = _smoothed(spec, needs, memory, now)
    total = sum(v.total_s for v in lats.values() if v.total_s is not None)
    whole = f"pipeline {spec.name} {total * 1000:.0f}ms of its {budget * 1000:.0f}ms budget"
    rows: list[StepBudget] = []
    for s in spec.steps:
        lat = lats[s.name]
        share = shares[s.name]
        mine = share * budget
        own = own_ttft.get(s.deployment)
        own_i = (own_itl or {}).get(s.deployment)
        if own is None:
            continue
        over = lat.total_s is not None and lat.total_s > mine
        unreachable = False
        need = "" if needs[s.name] is None or lat.total_s is None or needs[s.name] == lat.total_s else (
            f", needs {needs[s.name] * 1000:.0f}ms at least load")  # fmt: skip
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
            out_of_reach = (least[s.name] or StepFloor()).reaches(
                target if target < own else None,
                itl if itl is not None and itl < (own_i or 0.0) else None,
            )
            head = (
                f"{whole}: step {s.name} over its share {100 * share:.0f}% "
                f"({lat.total_s * 1000:.0f}ms > {mine * 1000:.0f}ms{need}"
            )
            if out_of_reach:
                reason = (
                    f"{head}), over budget: unreachable by scaling ({'; '.join(out_of_reach)}), "
                    f"its own targets kept"
                )
                target, itl, unreachable = own, None, True
            else:
                reason = f"{head}{note}), TTFT target {own:g}s -> {target:.3g}s"
        else:
            target, itl = own, None
            seen = "not measured" if lat.total_s is None else f"{lat.total_s * 1000:.0f}ms"
            reason = f"{whole}: step {s.name} within its share {100 * share:.0f}% ({seen} <= {mine * 1000:.0f}ms{need})"
        rows.append(StepBudget(spec.name, s.name, s.deployment, share, mine, lat.total_s, own, target,
                               over, 0, reason, itl, unreachable, needs[s.name]))  # fmt: skip
    return _ranked(rows, {s.name: lats[s.name].total_s for s in spec.steps}, budget)


def _ranked(rows: list[StepBudget], measured: Mapping[str, float | None], budget: float) -> list[StepBudget]:
    """Priorities (measured / share, then the excess; equal keys, equal priority) and which of
    the steps over are tightened: in priority order, until the pipeline meets its budget with
    the rest at their measured latency; none while it already does."""
    over = [b for b in rows if b.over and not b.unreachable]
    key = {b.step: (-(b.measured_s or 0.0) / b.budget_s, -((b.measured_s or 0.0) - b.budget_s)) for b in over}
    order = sorted(key.values())
    rank = {step: 1 + order.index(k) for step, k in key.items()}
    at = {name: m for name, m in measured.items() if m is not None}
    tightened: set[str] = set()
    for b in sorted(over, key=lambda b: key[b.step]):
        if sum(at.values()) <= budget:
            break
        tightened.add(b.step)
        at[b.step] = b.budget_s
    out = []
    for b in rows:
        if b.step in rank and b.step not in tightened:
            b = replace(b, tightened=False, target_ttft_s=b.own_ttft_s, target_itl_s=None,
                        reason=f"{b.reason.rsplit('), TTFT target', 1)[0]}): the steps further over meet the "
                               f"budget, its own targets kept")  # fmt: skip
        out.append(replace(b, priority=rank.get(b.step, 0)))
    return out


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
    pipelines = [p for p in pipelines if p.slo_e2e_s is not None]
    memory.keep(pipelines)
    for spec in pipelines:
        for b in _one(spec, latency, own_ttft, memory, now, own_itl, floors):
            before = out.get(b.deployment)
            if before is None or (b.target_ttft_s, -b.priority) < (before.target_ttft_s, -before.priority):
                out[b.deployment] = b
    return out
