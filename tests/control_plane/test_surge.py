"""The surge budget policy: table tests and a simulated rollout on a full pool whose
ready count is checked against `replicas - max_unavailable` on every pass."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.rollouts.policy import DEFAULT_STEPS, canary_replicas
from control_plane.rollouts.surge import (
    CapacityInputs,
    check_budget,
    plan_capacity,
    resolve_surge,
    resolve_unavailable,
)


@pytest.mark.parametrize(
    ("value", "replicas", "surge", "unavailable"),
    [
        ("25%", 4, 1, 1),
        ("25%", 2, 1, 1),  # unavailable: at least 1 so a full cluster can still replace
        ("25%", 10, 3, 2),  # surge rounds up, unavailable down
        ("0", 4, 0, 0),
        ("0%", 4, 0, 0),
        ("3", 2, 3, 2),  # never more unavailable than replicas
        ("100%", 4, 4, 4),
        ("25%", 0, 0, 0),
    ],
)
def test_resolve(value, replicas, surge, unavailable):
    assert resolve_surge(value, replicas) == surge
    assert resolve_unavailable(value, replicas) == unavailable


@pytest.mark.parametrize("bad", ["", "-1", "25", "abc", "101%", "1.5", "%", "25 %"])
def test_bad_budgets(bad):
    if bad == "25":
        assert check_budget(bad) == "25"
        return
    with pytest.raises(ValueError):
        check_budget(bad)


def _x(**kw) -> CapacityInputs:
    base = dict(
        replicas=4,
        canary_wanted=1,
        canary_ready=0,
        canary_assigned=0,
        baseline_assigned=4,
        baseline_ready=4,
        free_slots=0,
        max_surge=1,
        max_unavailable=1,
    )
    return CapacityInputs(**{**base, **kw})


@pytest.mark.parametrize(
    ("inputs", "baseline", "canary", "mode"),
    [
        (_x(free_slots=8), 4, 1, "surge"),  # free room: the baseline stays whole
        (_x(free_slots=0), 3, 1, "replace"),  # full: drain one baseline replica for the canary
        (_x(free_slots=0, canary_assigned=1, baseline_assigned=3), 3, 1, "replace"),  # stable next pass
        (_x(free_slots=0, max_unavailable=0), 4, 0, "surge"),  # no budget to replace: wait
        (_x(free_slots=8, max_surge=0), 3, 1, "replace"),  # surge forbidden: replace even with room
        (_x(canary_wanted=4, free_slots=8), 3, 2, "replace"),  # a big step: surge 1 and replace 1
        (_x(canary_wanted=2, canary_ready=1, canary_assigned=1, baseline_assigned=3), 2, 2, "replace"),
        (_x(canary_wanted=1, canary_ready=1, canary_assigned=1, baseline_assigned=3), 3, 1, "ready"),
        # a baseline replica still starting counts against the budget: nothing more is drained
        (_x(free_slots=0, baseline_ready=3), 4, 0, "surge"),
    ],
)
def test_table(inputs, baseline, canary, mode):
    plan = plan_capacity(inputs)
    assert (plan.baseline, plan.canary, plan.mode) == (baseline, canary, mode), plan.reason
    assert plan.min_ready == inputs.replicas - inputs.max_unavailable


def test_reasons_say_why():
    assert "drained" in plan_capacity(_x()).reason
    assert "free capacity" in plan_capacity(_x(free_slots=3)).reason
    assert "waiting" in plan_capacity(_x(max_unavailable=0)).reason


def _simulate(replicas: int, slots: int, steps, surge: int, unavailable: int) -> tuple[list[int], int]:
    """Pass by pass on a pool of `slots` 1-GPU slots the deployment alone uses: the plan's
    counts are applied (removals at once, additions pending), then pending canaries become
    ready; the ready count is recorded after every change. Returns the ready counts and
    the canary's ready replicas at the end."""
    baseline_ready, canary_ready, canary_pending = replicas, 0, 0
    ready_log = [replicas]
    for percent in steps:
        wanted = canary_replicas(replicas, percent)
        for _ in range(4 * replicas + 4):
            assigned = baseline_ready + canary_ready + canary_pending
            plan = plan_capacity(
                CapacityInputs(
                    replicas=replicas,
                    canary_wanted=wanted,
                    canary_ready=canary_ready,
                    canary_assigned=canary_ready + canary_pending,
                    baseline_assigned=baseline_ready,
                    baseline_ready=baseline_ready,
                    free_slots=slots - assigned,
                    max_surge=surge,
                    max_unavailable=unavailable,
                )
            )
            baseline_ready = min(baseline_ready, plan.baseline)  # drained first
            ready_log.append(baseline_ready + canary_ready)
            room = slots - baseline_ready - canary_ready - canary_pending
            canary_pending = min(max(0, plan.canary - canary_ready), canary_pending + max(0, room))
            assert baseline_ready + canary_ready + canary_pending <= slots
            canary_ready, canary_pending = canary_ready + canary_pending, 0  # they become ready
            ready_log.append(baseline_ready + canary_ready)
            if canary_ready >= wanted:
                break
        assert canary_ready >= wanted, f"stuck at step {percent}%: {canary_ready}/{wanted}"
    return ready_log, canary_ready


def test_full_cluster_rollout_reaches_100_within_the_bound():
    ready, canary = _simulate(replicas=4, slots=4, steps=(10, 30, 60, 100), surge=1, unavailable=1)
    assert min(ready) >= 3
    assert 3 in ready  # it did replace (never more than one out at a time)
    assert canary == 4


@settings(max_examples=150, deadline=None)
@given(
    replicas=st.integers(1, 12),
    spare=st.integers(0, 4),
    surge=st.sampled_from(["0", "1", "25%", "50%"]),
    unavailable=st.sampled_from(["0", "1", "25%", "100%"]),
    steps=st.sampled_from([DEFAULT_STEPS, (10.0, 30.0, 60.0, 100.0), (100.0,), (50.0, 100.0)]),
)
def test_any_rollout_keeps_the_bound(replicas, spare, surge, unavailable, steps):
    s, u = resolve_surge(surge, replicas), resolve_unavailable(unavailable, replicas)
    if (spare == 0 and u == 0) or (s == 0 and u == 0):
        return  # cannot progress by design (refused by the API when both are 0)
    ready, canary = _simulate(replicas, replicas + spare, steps, s, u)
    assert min(ready) >= replicas - u
    assert canary == replicas


# --------------------------------------------------------------------- through reconcile's inputs


def _snapshot(free_nodes: int = 0, shadowing: bool = False):
    from control_plane.fleet_model.snapshot import (
        AssignmentRow,
        ClusterRow,
        DeploymentRow,
        FleetSnapshot,
        PoolRow,
        VersionSpec,
    )
    from control_plane.rollouts.store import RolloutPlan

    return FleetSnapshot(
        deployments=(DeploymentRow(name="web", replicas=4, current_version=1),),
        specs={("web", v): VersionSpec(deployment="web", version=v, model="m") for v in (1, 2)},
        clusters=(ClusterRow(id="c1", pools=(PoolRow(name="p", gpu_model="sim", nodes=4 + free_nodes),)),),
        assignments=tuple(
            AssignmentRow(
                replica_id=f"web-v1-{i}", deployment="web", version=1, cluster="c1", pool="p", state="ready"
            )
            for i in range(4)
        ),
        rollouts={
            "web": RolloutPlan(
                deployment="web",
                baseline_version=1,
                canary_version=2,
                canary_replicas=1,
                canary_weight=0.0,
                shadowing=shadowing,
            )
        },
    )


def test_full_pool_canary_replaces_a_baseline_replica_in_the_placer():
    from control_plane.fleet_model.plan import placement_inputs, removal_reasons
    from control_plane.placement import FirstFitDecreasing
    from control_plane.rollouts.capacity_status import capacity_numbers

    snap = _snapshot()
    demands, pools, current = placement_inputs(snap)
    assert {(d.version, d.count) for d in demands} == {(1, 3), (2, 1)}
    result = FirstFitDecreasing().place(demands, pools, current)
    assert len(result.removed) == 1 and [a.version for a in result.added] == [2]
    assert not result.unplaced and not result.preempted
    assert "canary rollout" in removal_reasons(snap, result)[result.removed[0]]
    numbers = capacity_numbers(snap)["web"]
    assert numbers["capacity_mode"] == "replace" and numbers["min_ready"] == 3 and numbers["ready"] == 4


def test_free_capacity_surges_without_touching_the_baseline():
    from control_plane.fleet_model.plan import placement_inputs
    from control_plane.placement import FirstFitDecreasing

    snap = _snapshot(free_nodes=2)
    demands, pools, current = placement_inputs(snap)
    result = FirstFitDecreasing().place(demands, pools, current)
    assert not result.removed and [a.version for a in result.added] == [2]


@pytest.mark.parametrize(
    ("inputs", "baseline", "canary"),
    [
        # room for the first step's replicas: all of them beside the whole baseline
        (_x(free_slots=2), 4, 1),
        # a full pool: the baseline keeps every replica, the canary waits for room
        (_x(free_slots=0), 4, 0),
        # ready canary replicas, none free: it keeps what it has, the baseline stays whole
        (_x(canary_wanted=2, canary_ready=1, canary_assigned=1), 4, 1),
        # beyond max_surge (0 here): the shadow's replicas are temporary, free capacity bounds them
        (_x(canary_wanted=2, free_slots=3, max_surge=0), 4, 2),
    ],
)
def test_a_shadow_phase_never_costs_the_baseline_a_replica(inputs, baseline, canary):
    plan = plan_capacity(inputs.model_copy(update={"shadowing": True}))
    assert (plan.baseline, plan.canary, plan.mode) == (baseline, canary, "surge")
    assert "shadow phase" in plan.reason


def test_a_shadow_phase_on_a_full_pool_drains_nothing_in_the_placer():
    from control_plane.fleet_model.plan import placement_inputs
    from control_plane.placement import FirstFitDecreasing

    snap = _snapshot(shadowing=True)
    demands, pools, current = placement_inputs(snap)
    result = FirstFitDecreasing().place(demands, pools, current)
    assert not result.removed and not result.added  # vs. one replaced outside the phase


@pytest.mark.parametrize(
    ("inputs", "keep", "current", "mode"),
    [
        # rolled back at step 1: 3 baseline ready hold the bound, the canary goes at once
        (_x(canary_ready=3, canary_assigned=3, baseline_assigned=1, baseline_ready=1), 0, 4, "ready"),
        # rolled back at step 3 on a full pool: 2 old stay, 1 replacement starts in the slot freed
        (_x(canary_ready=1, canary_assigned=1, baseline_assigned=3, baseline_ready=3), 2, 2, "replace"),
        # everything was the old version: 3 stay (max_unavailable 1), 1 replacement starts
        (_x(canary_ready=0, canary_assigned=0, baseline_assigned=4, baseline_ready=4), 3, 1, "replace"),
        # free room changes nothing about how fast old replicas go, only where new ones start
        (
            _x(canary_ready=1, canary_assigned=1, baseline_assigned=3, baseline_ready=3, free_slots=4),
            2,
            4,
            "replace",
        ),
    ],
)
def test_drain_table(inputs, keep, current, mode):
    from control_plane.rollouts.surge import plan_drain

    plan = plan_drain(inputs)
    assert (plan.baseline, plan.canary, plan.mode) == (keep, current, mode), plan.reason


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 12),
    data=st.data(),
)
def test_a_drain_on_a_full_pool_keeps_the_bound_and_finishes(n, data):
    """After a rollback at any point (some replicas current, the rest old, all ready) on a
    pool with `free` spare slots: each pass removes what the plan lets go, then starts
    what fits; started replicas are ready by the next pass."""
    from control_plane.rollouts.surge import plan_drain

    current = data.draw(st.integers(0, n))
    free = data.draw(st.integers(0, 2))
    unavailable = resolve_unavailable(data.draw(st.sampled_from(["1", "25%", "50%", "100%"])), n)
    slots, old, ready = n + free, n - current, current
    for _ in range(2 * n + 2):
        plan = plan_drain(
            CapacityInputs(
                replicas=n, canary_wanted=n, canary_ready=ready, canary_assigned=ready,
                baseline_assigned=old, baseline_ready=old, free_slots=slots - old - ready,
                max_surge=1, max_unavailable=unavailable,
            )
        )  # fmt: skip
        old = min(old, plan.baseline)
        assert ready + old >= n - unavailable  # after the removals, before anything new is ready
        ready = min(plan.canary, slots - old)  # what was started is ready next pass
        if old == 0 and ready == n:
            break
    assert (old, ready) == (0, n)
