"""Placement as one pipeline, the same for the reconcile loop, `fleetctl plan` and tests:

    split     warm standby replicas set aside, their GPUs reserved (`standby.split`), and
              a silent cluster's unreachable replicas, for the hold step
    solve     the named placer from the registry (or one given), warm-started from the
              previous plan passed in (`SolvedPlan`); placers keep no state
    verify    every hard rule, no running replica dropped, no priority or quota rule
              broken (`evaluate.plan_problems`); a plan that fails, or a placer that
              raises, is replaced by first-fit-decreasing (made spot-share safe)
    hold      the unreachable replicas kept while their version lacks ready replicas
              elsewhere, the rest removed (`hold.hold_unreachable`)
    complete  the standby replicas added back (`standby.complete`), a pipeline step's
              only where the plan holds every other step of its pipeline
    explain   why each removed replica goes (`explain.removal_reasons`); shortfalls
              carry their reasons from the placers

Pure and synchronous: no database, no I/O, no clock but the solve's own timing.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from control_plane.placement.base import (
    Assignment,
    PlacementResult,
    Placer,
    PoolCapacity,
    ReplicaDemand,
    SolvedPlan,
    SolveInfo,
    fingerprint_assignments,
    fingerprint_inputs,
    get_placer,
)
from control_plane.placement.colocation import groups
from control_plane.placement.evaluate import plan_cost, plan_problems
from control_plane.placement.explain import RemovalContext, removal_reasons
from control_plane.placement.ffd import FirstFitDecreasing, spot_safe_ffd
from control_plane.placement.hold import hold_unreachable, waiting
from control_plane.placement.quotas import NO_QUOTAS, GpuQuotas
from control_plane.placement.standby import StandbyDemand, complete, split
from fleet_base.pipelines import PipelineSpec


class PlacementInputs(BaseModel):
    """Everything a plan is made from. `current` is what runs now (node indices where
    known); `standby` the warm standby of deployments that have one."""

    model_config = ConfigDict(frozen=True)

    demands: tuple[ReplicaDemand, ...] = ()
    pools: tuple[PoolCapacity, ...] = ()
    current: tuple[Assignment, ...] = ()
    standby: tuple[StandbyDemand, ...] = ()
    pipelines: tuple[PipelineSpec, ...] = ()  # steps co-placed: all in a cluster or none
    ready: frozenset[str] = frozenset()  # replica ids last reported ready
    unreachable: frozenset[str] = frozenset()  # ready when their cluster went silent


class PlacementOutcome(BaseModel):
    """The plan and what the pipeline learned making it."""

    model_config = ConfigDict(frozen=True)

    result: PlacementResult
    info: SolveInfo | None = None  # how the solve went (None: the placer does not say)
    solved: SolvedPlan | None = None  # hand it back as `previous` on the next pass
    reasons: dict[str, str] = {}  # removed replica id -> why it goes
    problems: tuple[str, ...] = ()  # rules the chosen plan still breaks (FFD's own plan)


def run(
    inputs: PlacementInputs,
    placer: Placer | str,
    *,
    quotas: GpuQuotas | None = None,
    previous: SolvedPlan | None = None,
    lp_bound: bool = False,
    context: RemovalContext | None = None,
) -> PlacementOutcome:
    """split -> solve -> verify -> hold -> complete -> explain. `placer` is a name in the
    registry (built afresh, with `quotas`) or an instance (its own quotas)."""
    if isinstance(placer, str):
        placer = get_placer(placer)
        placer.quotas = quotas or NO_QUOTAS
    quotas = getattr(placer, "quotas", None) or NO_QUOTAS
    held_back = waiting(inputs.current, inputs.pools, inputs.unreachable)  # the hold step's to decide
    ids = {a.replica_id for a in held_back}
    kept = split(inputs.standby, inputs.pools, tuple(a for a in inputs.current if a.replica_id not in ids))
    demands, pools, current = inputs.demands, kept.pools, kept.current
    started = time.perf_counter()
    try:
        with_pipelines = {"pipelines": inputs.pipelines} if inputs.pipelines else {}
        result, info = placer.solve(
            demands, pools, current, lp_bound=lp_bound, previous=previous, **with_pipelines
        )
        problems = plan_problems(demands, pools, current, result, quotas, inputs.pipelines)
        note = f"the plan does not check out: {'; '.join(problems[:3])}" if problems else ""
    except ValueError:
        raise  # bad input (a duplicate demand), not a solver failure
    except Exception as e:
        result, info, problems, note = PlacementResult(), None, ["raised"], f"{type(e).__name__}: {e}"
    if problems and not isinstance(placer, FirstFitDecreasing) and not _is_fallback(info):
        result = spot_safe_ffd(demands, pools, current, quotas=quotas, pipelines=inputs.pipelines)
        info = _fallback_info(pools, result, started, note, info)
        problems = []
    solved = _remember(placer, demands, pools, quotas, result, info, inputs.pipelines)
    result = hold_unreachable(result, held_back, demands, inputs.pools, inputs.ready)
    steps = groups(inputs.pipelines, demands, inputs.pools) if inputs.pipelines else []
    result = complete(inputs.standby, inputs.pools, result, kept, steps)
    reasons = removal_reasons(inputs.current, inputs.pools, result, context) if context else {}
    return PlacementOutcome(
        result=result, info=info, solved=solved, reasons=reasons, problems=tuple(problems)
    )


def _is_fallback(info: SolveInfo | None) -> bool:
    """The placer already answered with its own greedy plan (too big to solve, or failed)."""
    return info is not None and info.method.startswith("greedy")


def _fallback_info(
    pools: tuple[PoolCapacity, ...],
    result: PlacementResult,
    started: float,
    note: str,
    info: SolveInfo | None,
) -> SolveInfo:
    return SolveInfo(
        method="greedy-error",
        cost=round(plan_cost(pools, result.assignments), 6),
        solve_s=round(time.perf_counter() - started, 4),
        variables=info.variables if info else 0,
        note=note,
    )


def _remember(placer, demands, pools, quotas, result, info, pipelines=()) -> SolvedPlan | None:
    """The placer's own plan (before the standby is added back), keyed as the placer
    will look it up next time."""
    if info is None:
        return None
    fingerprint = getattr(placer, "fingerprint", None)
    inputs = (
        fingerprint(demands, pools, pipelines)
        if fingerprint
        else fingerprint_inputs(demands, pools, (quotas.fingerprint(), tuple(pipelines)))
    )
    return SolvedPlan(
        inputs=inputs,
        assignments=fingerprint_assignments(result.assignments),
        unplaced=result.unplaced,
        info=info,
    )
