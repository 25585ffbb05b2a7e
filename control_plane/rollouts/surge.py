"""Surge budgets: how a rollout step gets room for its canary when the pool is full.

`max_surge` (replicas above the desired count) and `max_unavailable` (below it, counted
as not ready) are per deployment, each a count ("2") or a percentage of the desired
replicas ("25%"): surge rounds up, unavailable rounds down but is at least 1 when given
as a percentage, so a full cluster can always replace one replica at a time. A count of
0 is honoured (0 unavailable: the rollout only surges, and waits for free capacity);
both 0 cannot make progress and are refused.

`plan_capacity` is the whole policy: plain, synchronous, table-tested. Free capacity
is used first (surge); the rest is found by giving up baseline replicas (replace: the
placer drains them and starts the canary on their GPUs), never so many that fewer than
`replicas - max_unavailable` stay ready.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_SURGE = "25%"
DEFAULT_MAX_UNAVAILABLE = "25%"
BUDGET_PATTERN = r"^(?:\d{1,4}|\d{1,3}(?:\.\d+)?%)$"
_BUDGET = re.compile(BUDGET_PATTERN)

Mode = Literal["surge", "replace", "ready"]


def check_budget(value: str) -> str:
    """`value` if it is a count (0..9999) or a percentage (0..100%); ValueError otherwise."""
    if not _BUDGET.match(value):
        raise ValueError(f"{value!r} must be a replica count like '1' or a percentage like '25%'")
    if value.endswith("%") and float(value[:-1]) > 100:
        raise ValueError(f"{value!r}: a percentage is at most 100%")
    return value


def resolve_surge(value: str, replicas: int) -> int:
    """Replicas allowed above `replicas` (a percentage rounds up)."""
    check_budget(value)
    if value.endswith("%"):
        return math.ceil(replicas * float(value[:-1]) / 100 - 1e-9)
    return int(value)


def resolve_unavailable(value: str, replicas: int) -> int:
    """Replicas allowed to be not ready (a percentage rounds down, but to at least 1
    when the deployment has replicas, so a replacement can always start)."""
    check_budget(value)
    if value.endswith("%"):
        n = math.floor(replicas * float(value[:-1]) / 100 + 1e-9)
        return min(replicas, max(1, n)) if replicas > 0 and float(value[:-1]) > 0 else n
    return min(replicas, int(value))


class CapacityInputs(BaseModel):
    """One deployment during a canary rollout, as reconcile sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    replicas: int = Field(ge=0)  # desired
    canary_wanted: int = Field(ge=0)  # the step's canary replicas
    canary_ready: int = Field(0, ge=0)
    canary_assigned: int = Field(0, ge=0)  # placed, ready or not
    baseline_assigned: int = Field(0, ge=0)
    baseline_ready: int = Field(0, ge=0)
    free_slots: int = Field(0, ge=0)  # further replicas of the canary's shape the pools could take
    max_surge: int = Field(ge=0)
    max_unavailable: int = Field(ge=0)
    # The rollout's shadow phase: the canary serves no user, so it may not cost the baseline
    # a replica (users' latency must not change); it runs on free capacity or waits.
    shadowing: bool = False


class CapacityPlan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    baseline: int  # baseline replicas wanted now
    canary: int  # canary replicas wanted now
    mode: Mode
    min_ready: int  # the bound: replicas - max_unavailable
    reason: str


def plan_capacity(x: CapacityInputs) -> CapacityPlan:
    """Replica counts for both versions now. The canary may get fewer than its step
    wants (the next pass, after some become ready, frees more); the step waits for them."""
    total = x.replicas
    wanted = min(total, x.canary_wanted)
    ready = min(x.canary_ready, wanted)
    full = total - ready  # the baseline shrinks only as canary replicas become ready
    min_ready = max(0, total - x.max_unavailable)
    if x.shadowing:
        return _shadow_capacity(x, wanted, min_ready)
    if ready >= wanted:
        return CapacityPlan(
            baseline=full, canary=wanted, mode="ready", min_ready=min_ready, reason="canary replicas ready"
        )
    room = x.free_slots + x.baseline_assigned + x.canary_assigned  # slots this deployment can hold
    limit = min(total + x.max_surge, room)
    not_ready = max(0, x.baseline_assigned - x.baseline_ready)
    floor = min(full, max(0, min_ready - ready + not_ready))  # keeps min_ready ready at worst
    baseline = max(floor, min(full, limit - wanted))
    canary = max(ready, min(wanted, limit - baseline))
    if baseline == full:
        mode: Mode = "surge"
        reason = f"{canary - ready} canary replica(s) starting on free capacity (max_surge {x.max_surge})"
    else:
        mode = "replace"
        reason = (
            f"{full - baseline} baseline replica(s) drained for the canary: free capacity holds "
            f"{max(0, room - total)} of {wanted - ready} needed; ready stays >= {min_ready} "
            f"(max_unavailable {x.max_unavailable})"
        )
    if canary < wanted:
        reason += f"; {wanted - canary} more wait until these are ready"
    if canary <= ready:
        reason = (
            f"no room: no free capacity (max_surge {x.max_surge}) and max_unavailable {x.max_unavailable} "
            f"is used up; waiting"
        )
    return CapacityPlan(baseline=baseline, canary=canary, mode=mode, min_ready=min_ready, reason=reason)


def _shadow_capacity(x: CapacityInputs, wanted: int, min_ready: int) -> CapacityPlan:
    """The whole baseline, and the canary's first-step replicas on free capacity only
    (beyond `max_surge`: they are temporary and bounded by the first step); short of room,
    the shadow phase waits (and stops at its ready timeout) rather than drain a baseline
    replica that users are served by."""
    canary = min(wanted, x.canary_assigned + x.free_slots)
    if canary >= wanted:
        reason = f"shadow phase: {wanted} canary replica(s) on free capacity beside the whole baseline"
    else:
        reason = (
            f"shadow phase: free capacity holds {canary} of the canary's {wanted} replica(s); "
            "the baseline keeps every replica, so the phase waits for room"
        )
    return CapacityPlan(baseline=x.replicas, canary=canary, mode="surge", min_ready=min_ready, reason=reason)


def plan_drain(x: CapacityInputs) -> CapacityPlan:
    """The other way round, once no rollout runs (a rolled-back or aborted canary, the
    old baseline after a promotion, a spec change): `baseline_*` are the old version's
    ready replicas, `canary_*` the current version's. Old replicas go as fast as the
    bound allows (a rolled-back version should serve as little as it can): only as many
    stay as are needed to hold `replicas - max_unavailable` ready while the current
    version comes up on free capacity and on the slots the others leave."""
    total = x.replicas
    min_ready = max(0, total - x.max_unavailable)
    ready = min(x.canary_ready, total)
    keep = min(x.baseline_ready, max(0, min_ready - ready))
    room = x.free_slots + x.baseline_assigned + x.canary_assigned
    current = max(min(total, x.canary_assigned), min(total, room - keep))
    if keep == 0:
        reason = f"old replicas drained: {ready} of {total} current ready (>= {min_ready})"
        return CapacityPlan(baseline=0, canary=total, mode="ready", min_ready=min_ready, reason=reason)
    reason = (
        f"{keep} old replica(s) kept until the current version's replacements are ready; "
        f"ready stays >= {min_ready} (max_unavailable {x.max_unavailable})"
    )
    return CapacityPlan(baseline=keep, canary=current, mode="replace", min_ready=min_ready, reason=reason)
